import sys

import pytest

sys.path.insert(0, "/app")
sys.dont_write_bytecode = True

from textutils import slugify  # noqa: E402


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Hello World", "hello-world"),
        ("Hello, World!", "hello-world"),
        ("  leading and trailing  ", "leading-and-trailing"),
        ("a--b__c", "a-b-c"),
        ("C++ & Python 3.11", "c-python-3-11"),
        ("already-a-slug", "already-a-slug"),
        ("MiXeD123Case", "mixed123case"),
        ("!!!", ""),
        ("", ""),
    ],
)
def test_slugify(text, want):
    assert slugify(text) == want
