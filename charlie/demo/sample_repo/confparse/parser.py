from confparse.settings import COMMENT_PREFIXES, STRIP_WHITESPACE


def parse(text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith(COMMENT_PREFIXES):
            continue
        if "=" not in stripped:
            raise ValueError(f"line {number}: expected 'key = value', got {line!r}")
        key, value = stripped.split("=", 1)
        if STRIP_WHITESPACE:
            key, value = key.strip(), value.strip()
        values[key] = value
    return values
