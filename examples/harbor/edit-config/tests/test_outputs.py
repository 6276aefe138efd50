import configparser

import pytest

PATH = "/app/config.ini"


@pytest.fixture(scope="module")
def cfg():
    parser = configparser.ConfigParser()
    assert parser.read(PATH) == [PATH], "config.ini missing or unreadable"
    return parser


def test_port(cfg):
    assert cfg.get("server", "port").strip() == "9090"


def test_debug_off(cfg):
    assert cfg.get("server", "debug").strip().lower() == "false"


def test_name_kept(cfg):
    assert cfg.get("server", "name").strip() == "demo"


def test_logging_kept(cfg):
    assert cfg.get("logging", "level").strip() == "info"


def test_no_duplicate_or_extra_sections(cfg):
    assert cfg.sections() == ["server", "logging"]
    assert set(cfg["server"]) == {"port", "debug", "name"}
