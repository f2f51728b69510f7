from confparse.parser import parse

__all__ = ["parse"]
