import unittest

from confparse import parse


class ParserTest(unittest.TestCase):
    def test_pairs(self) -> None:
        self.assertEqual(parse("a = 1\nb=2"), {"a": "1", "b": "2"})

    def test_semicolon_comments_are_ignored(self) -> None:
        self.assertEqual(parse("; note\na = 1"), {"a": "1"})

    def test_hash_comments_are_ignored(self) -> None:
        # Regression: configs written before 2.4 use '#' comments.
        self.assertEqual(parse("# note\na = 1"), {"a": "1"})


if __name__ == "__main__":
    unittest.main()
