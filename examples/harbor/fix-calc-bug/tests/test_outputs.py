import importlib
import sys

import pytest

sys.path.insert(0, "/app")
sys.dont_write_bytecode = True


@pytest.fixture(scope="module")
def calc():
    for name in [m for m in sys.modules if m == "calc" or m.startswith("calc.")]:
        del sys.modules[name]
    return importlib.import_module("calc")


def test_add(calc):
    assert calc.add(2, 3) == 5
    assert calc.add(-1, 1) == 0


def test_sub(calc):
    assert calc.sub(5, 3) == 2
    assert calc.sub(3, 5) == -2
    assert calc.sub(0, 0) == 0


def test_mul(calc):
    assert calc.mul(4, 3) == 12
    assert calc.mul(-2, 3) == -6


def test_div(calc):
    assert calc.div(7, 2) == 3.5
    assert calc.div(-7, 2) == -3.5
    assert calc.div(6, 3) == 2
    assert calc.div(1, 4) == 0.25


def test_div_by_zero(calc):
    with pytest.raises(ZeroDivisionError):
        calc.div(1, 0)
