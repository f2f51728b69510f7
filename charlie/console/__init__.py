"""The run console: a web view of runs where people see what happened and act.

``charlie ui`` serves it (:mod:`charlie.console.server`). It reads the database the workers
use through the Python API only (``charlie.api``, ``charlie.views``), and every action it takes
is the API's, recorded with the console's operator name (I27). Pages are server-rendered
Tornado templates with autoescape on; ``static/console.js`` polls a cheap revision read and
swaps server-rendered fragments, so every byte of attacker-controlled text (prompts, tool
arguments and results) is escaped on the server.
"""
