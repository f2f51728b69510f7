"""Parser settings.

Changed in 2.4: comment prefixes are configurable (release note: "support ';' comments").
"""

# Lines starting with one of these are comments.
COMMENT_PREFIXES = (";",)

# Whitespace around keys and values is stripped.
STRIP_WHITESPACE = True
