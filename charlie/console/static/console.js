// The run console's only script: follow a page live without a reload.
//
// A task page polls its cheap revision read (/api/tasks/<id>/revision) every second; when the
// revision changed it fetches the page's server-rendered regions (/live/tasks/<id>) and swaps
// those that differ. The list polls its table (/live/tasks?...) every two seconds. Every byte
// of data arrives escaped by the server: this script never builds HTML from data; it parses
// the server's fragment into an inert document and moves its nodes in, and writes its own
// words with textContent only.
(function () {
  "use strict";

  var live = document.querySelector("[data-live]");
  var stateLine = document.getElementById("live-state");

  // No double submit: a form's buttons are disabled once it is sent.
  document.addEventListener("submit", function (event) {
    var form = event.target;
    window.setTimeout(function () {
      form.querySelectorAll("button").forEach(function (b) { b.disabled = true; });
    }, 0);
  });

  // An opened call row loads its whole record (arguments, result, evidence), rendered by the
  // server, the first time it is opened: a run of thousands of calls stays a light page.
  function loadFull(details) {
    var lazy = details.querySelector(":scope > .full[data-lazy]");
    var url = details.getAttribute("data-full");
    if (!lazy || !url || lazy.hasAttribute("data-loading")) {
      return;
    }
    lazy.setAttribute("data-loading", "");
    fetch(url, { credentials: "same-origin", cache: "no-store", headers: { Accept: "text/html" } })
      .then(function (r) {
        if (!r.ok) {
          throw new Error("the console answered " + r.status);
        }
        return r.text();
      })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var full = doc.querySelector(".full");
        if (full && lazy.isConnected) {
          lazy.replaceWith(document.importNode(full, true));
        }
      })
      .catch(function (err) {
        lazy.removeAttribute("data-loading");
        lazy.textContent = "could not load the record: " + err.message;
      });
  }

  document.addEventListener("toggle", function (event) {
    var details = event.target;
    if (details.tagName === "DETAILS" && details.open && details.hasAttribute("data-full")) {
      loadFull(details);
    }
  }, true);

  // The live panel: what the current model call writes, as it writes it, from the run's event
  // stream (/api/tasks/<id>/events?after=OFFSET, polled). Text goes in with textContent only:
  // whatever a model wrote is shown as text, never parsed.
  var panel = document.getElementById("live-model");
  if (panel) {
    followEvents(panel);
  }

  function followEvents(panel) {
    var url = panel.getAttribute("data-events-url");
    var callLine = document.getElementById("live-call");
    var text = document.getElementById("live-text");
    var reasoning = document.getElementById("live-reasoning");
    var args = document.getElementById("live-args");
    var after = null;
    var call = null;
    var model = "";
    var attempt = 1;
    var argsOf = null;
    var done = false;
    // the task's model by the label the header gives it (a scripted model by its file's name)
    var taskModel = panel.getAttribute("data-model");
    var taskModelLabel = panel.getAttribute("data-model-label");
    // an event delivered twice (the stream is at-least-once) carries the id it had
    var seenIds = new Set();

    function reset() {
      text.textContent = "";
      text.hidden = true; // shown once the model writes text: a call of tools only has none
      reasoning.textContent = "";
      reasoning.hidden = true;
      args.textContent = "";
      args.hidden = true;
      argsOf = null;
    }

    // a model call is named as the rest of the page names things: its turn, the model, and
    // the attempt when it is a repeat; never the stream's internal call id
    function writer(e) {
      return "turn " + e.turn + ": " + model + (attempt > 1 ? " (attempt " + attempt + ")" : "");
    }

    function apply(e) {
      if (e.type === "end") {
        done = true;
        panel.setAttribute("data-finished", "true");
        if (!panel.hidden) {
          callLine.textContent += " · the task finished";
        }
        return;
      }
      if (e.type === "model_start") {
        call = e.call;
        model = String(e.model || "the model");
        callLine.title = model;
        if (model === taskModel && taskModelLabel) {
          model = taskModelLabel;
        }
        attempt = Number(e.attempt) || 1;
        reset();
        panel.hidden = false;
        panel.setAttribute("data-state", "writing");
        callLine.textContent = writer(e) + " is writing";
      } else if (e.type === "retrying") {
        // the model call failed and is asked again later (I36): say when, and why, in the
        // words and with the count of the page's header (the run's count of attempts)
        panel.hidden = false;
        panel.setAttribute("data-state", "retrying");
        var n = Number(e.attempts);
        callLine.textContent = "retrying the model call: " + n
          + (n === 1 ? " attempt failed" : " attempts failed") + "; next attempt at "
          + String(e.next_at || "").slice(11, 19) + " UTC; last error: " + String(e.error || "");
        return;
      } else if (e.call !== call) {
        return;
      } else if (e.type === "text") {
        text.hidden = false;
        text.textContent += e.text;
      } else if (e.type === "reasoning") {
        reasoning.hidden = false;
        reasoning.textContent += e.text;
      } else if (e.type === "tool_args") {
        args.hidden = false;
        if (e.call_id !== argsOf) {
          // each tool call's arguments under its tool's name, as the transcript shows calls
          args.textContent += (argsOf === null ? "" : "\n") + (e.name || "a tool") + " ";
          argsOf = e.call_id;
        }
        args.textContent += e.text;
      } else if (e.type === "model_restart") {
        reset();
        callLine.textContent += " (the stream was cut; asked again)";
      } else if (e.type === "model_end") {
        panel.setAttribute("data-state", e.status);
        // the model's call ended, not the task: a run may go on to wait for people
        // a turn that wrote tool calls did not write its answer (the calls run next)
        callLine.textContent = writer(e) + (e.status === "completed"
          ? (argsOf !== null ? " wrote its tool calls"
            : (text.hidden ? " finished writing" : " wrote its answer"))
          : " stopped: " + e.status + (e.reason ? " (" + e.reason + ")" : ""));
      }
    }

    function poll() {
      var query = after === null ? "" : "?after=" + encodeURIComponent(after);
      fetch(url + query, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (page) {
          if (!page) {
            return;
          }
          if (page.off) {
            done = true;
            return;
          }
          page.events.forEach(function (e) {
            if (e.id) {
              if (seenIds.has(e.id)) {
                return;
              }
              seenIds.add(e.id);
            }
            apply(e);
          });
          after = page.next;
        })
        .catch(function () { /* try again at the next tick */ })
        .then(function () {
          if (!done) {
            window.setTimeout(poll, 300);
          }
        });
    }

    poll();
  }

  if (!live) {
    return;
  }
  var revisionUrl = live.getAttribute("data-revision-url");
  var fragmentUrl = live.getAttribute("data-fragment-url");
  var revision = live.getAttribute("data-revision");
  var period = revisionUrl ? 1000 : 2000;
  // the server's HTML of each region and each keyed row, as last received
  var seen = new Map();
  var failures = 0;

  // The XSRF field is masked anew on every render: not a change worth a swap.
  function normal(html) {
    return html.replace(/name="_xsrf" value="[^"]*"/g, "");
  }

  function say(text, bad) {
    if (!stateLine) {
      return;
    }
    stateLine.textContent = text;
    stateLine.classList.toggle("bad", !!bad);
  }

  function remember(root) {
    root.querySelectorAll("[data-region]").forEach(function (region) {
      var name = region.getAttribute("data-region");
      seen.set("region:" + name, normal(region.outerHTML));
      if (region.hasAttribute("data-keyed")) {
        Array.prototype.forEach.call(region.children, function (child) {
          var key = child.getAttribute("data-key");
          if (key) {
            seen.set("row:" + name + ":" + key, normal(child.outerHTML));
          }
        });
      }
    });
  }

  // What a person has done on the page that a swap must keep: open details, typed text, focus.
  function capture(root) {
    var kept = { open: new Map(), values: new Map(), focus: null };
    root.querySelectorAll("details[data-key]").forEach(function (d) {
      kept.open.set(d.getAttribute("data-key"), d.open);
    });
    root.querySelectorAll("form[data-key] input, form[data-key] textarea, form[data-key] select")
      .forEach(function (field) {
        if (field.type === "hidden" || !field.name) {
          return;
        }
        var key = field.form.getAttribute("data-key") + ":" + field.name;
        kept.values.set(key, field.value);
        if (document.activeElement === field) {
          kept.focus = {
            key: key,
            start: field.selectionStart,
            end: field.selectionEnd,
          };
        }
      });
    return kept;
  }

  function restore(root, kept) {
    root.querySelectorAll("details[data-key]").forEach(function (d) {
      var key = d.getAttribute("data-key");
      if (kept.open.has(key)) {
        d.open = kept.open.get(key);
      }
    });
    root.querySelectorAll("form[data-key] input, form[data-key] textarea, form[data-key] select")
      .forEach(function (field) {
        if (field.type === "hidden" || !field.name) {
          return;
        }
        var key = field.form.getAttribute("data-key") + ":" + field.name;
        if (kept.values.has(key)) {
          field.value = kept.values.get(key);
        }
        if (kept.focus && kept.focus.key === key) {
          field.focus();
          try {
            field.setSelectionRange(kept.focus.start, kept.focus.end);
          } catch (e) {
            // not a text field
          }
        }
      });
  }

  function swapNode(old, fresh) {
    var kept = capture(old);
    var node = document.importNode(fresh, true);
    old.replaceWith(node);
    restore(node, kept);
    return node;
  }

  // A keyed region (the transcript): rows are replaced only where they changed, and new rows
  // are put in their place, so a long run's page does not redraw on every move.
  function swapKeyed(name, old, fresh) {
    var existing = new Map();
    Array.prototype.forEach.call(old.children, function (child) {
      var key = child.getAttribute("data-key");
      if (key) {
        existing.set(key, child);
      }
    });
    var previous = null;
    var wanted = new Set();
    Array.prototype.slice.call(fresh.children).forEach(function (child) {
      var key = child.getAttribute("data-key");
      var html = normal(child.outerHTML);
      var node;
      if (!key) {
        node = old.querySelector(":scope > " + child.tagName.toLowerCase() + ":not([data-key])");
        if (!node) {
          node = document.importNode(child, true);
          old.insertBefore(node, previous ? previous.nextSibling : old.firstChild);
        }
      } else {
        wanted.add(key);
        node = existing.get(key);
        if (!node) {
          node = document.importNode(child, true);
          old.insertBefore(node, previous ? previous.nextSibling : old.firstChild);
        } else if (seen.get("row:" + name + ":" + key) !== html) {
          node = swapNode(node, child);
        }
        seen.set("row:" + name + ":" + key, html);
      }
      previous = node;
    });
    existing.forEach(function (node, key) {
      if (!wanted.has(key)) {
        node.remove();
        seen.delete("row:" + name + ":" + key);
      }
    });
  }

  function swap(html) {
    var doc = new DOMParser().parseFromString(html, "text/html");
    var changed = 0;
    doc.querySelectorAll("[data-region]").forEach(function (fresh) {
      var name = fresh.getAttribute("data-region");
      var old = live.querySelector('[data-region="' + name + '"]');
      var text = normal(fresh.outerHTML);
      if (!old) {
        return;
      }
      if (seen.get("region:" + name) === text) {
        return;
      }
      changed += 1;
      if (fresh.hasAttribute("data-keyed")) {
        swapKeyed(name, old, fresh);
      } else {
        swapNode(old, fresh);
      }
      seen.set("region:" + name, text);
    });
    if (changed) {
      live.setAttribute("data-updated", String(Date.now()));
    }
  }

  function get(url, accept) {
    return fetch(url, {
      credentials: "same-origin",
      cache: "no-store",
      headers: { Accept: accept },
    }).then(function (response) {
      if (response.status === 401) {
        throw new Error("the session ended: open the console's address with its token again");
      }
      if (!response.ok) {
        throw new Error("the console answered " + response.status);
      }
      return response;
    });
  }

  function poll() {
    var work;
    if (revisionUrl) {
      work = get(revisionUrl, "application/json")
        .then(function (r) { return r.json(); })
        .then(function (body) {
          if (body.revision === revision) {
            return null;
          }
          var next = body.revision;
          return get(fragmentUrl, "text/html")
            .then(function (r) { return r.text(); })
            .then(function (html) {
              swap(html);
              revision = next;
            });
        });
    } else {
      work = get(fragmentUrl, "text/html")
        .then(function (r) { return r.text(); })
        .then(swap);
    }
    work.then(function () {
      failures = 0;
      say("live · " + new Date().toLocaleTimeString(), false);
    }).catch(function (err) {
      failures += 1;
      say("not live: " + err.message, true);
    }).then(function () {
      window.setTimeout(poll, Math.min(period * (1 + failures), 15000));
    });
  }

  remember(live);
  say("live", false);
  window.setTimeout(poll, period);
})();
