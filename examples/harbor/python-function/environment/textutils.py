"""Text helpers."""


def slugify(s: str) -> str:
    raise NotImplementedError
