"""``python -m charlie.devbox serve``: the devbox without the rest of Charlie's CLI."""

from charlie.devbox.cli import devbox

if __name__ == "__main__":
    devbox()
