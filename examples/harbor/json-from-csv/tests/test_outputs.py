"""Runs as the non-root user `nobody`: it only reads /app."""

import json

EXPECTED = [
    {"name": "Ada", "age": 36},
    {"name": "Grace Hopper", "age": 85},
    {"name": "Smith, Jr.", "age": 41},
    {"name": "Linus", "age": 7},
    {"name": "Zoë", "age": 29},
]


def load():
    with open("/app/people.json", encoding="utf-8") as fh:
        return json.load(fh)


def test_is_list_of_objects():
    data = load()
    assert isinstance(data, list)
    assert all(isinstance(item, dict) for item in data)


def test_keys_and_types():
    for item in load():
        assert set(item) == {"name", "age"}
        assert isinstance(item["name"], str)
        assert isinstance(item["age"], int) and not isinstance(item["age"], bool)


def test_content_in_order():
    assert load() == EXPECTED
