"""The one way the package calls a function in a fresh Python process: results come
back through JSON, and a child that raises, crashes or runs too long raises
:class:`~extkernels.fresh.FreshProcessError` with its standard error."""

import textwrap

import pytest

from extkernels import fresh

CHILD = textwrap.dedent(
    """
    import os, sys, time

    def echo(*args, **kwargs):
        return {"args": args, "kwargs": kwargs, "env": os.environ.get("FRESH_TEST")}

    def fail(message):
        raise ValueError(message)

    def crash(code):
        print("going down", file=sys.stderr)
        os._exit(code)

    def sleep(seconds):
        print("about to sleep", file=sys.stderr, flush=True)
        time.sleep(seconds)
    """
)


@pytest.fixture
def child(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


def test_a_result_comes_back_through_json(child):
    got = fresh.call(child, "echo", 1, [2.5, None], "x", k={"a": [1]}, env=None)
    assert got["args"] == [1, [2.5, None], "x"]
    assert got["kwargs"] == {"k": {"a": [1]}} and got["env"] is None


def test_env_is_set_in_the_child_only(child):
    assert fresh.call(child, "echo", env={"FRESH_TEST": "yes"})["env"] == "yes"


def test_a_module_is_called_by_its_import_name():
    assert fresh.call("json", "dumps", [1, 2]) == "[1, 2]"


def test_an_exception_in_the_child_surfaces_with_its_message(child):
    with pytest.raises(fresh.FreshProcessError, match="ValueError: no such thing") as e:
        fresh.call(child, "fail", "no such thing")
    assert e.value.returncode == 1
    assert "Traceback" in e.value.stderr
    assert isinstance(e.value, RuntimeError)


def test_a_crash_carries_the_return_code_and_stderr(child):
    with pytest.raises(fresh.FreshProcessError, match="exited with 3") as e:
        fresh.call(child, "crash", 3)
    assert e.value.returncode == 3 and "going down" in e.value.stderr


def test_a_child_past_its_timeout_raises(child):
    with pytest.raises(fresh.FreshProcessError, match="timed out") as e:
        fresh.call(child, "sleep", 30, timeout=1)
    assert e.value.returncode is None


def test_a_child_past_its_timeout_says_where_it_waited(child):
    with pytest.raises(fresh.FreshProcessError, match="timed out") as e:
        fresh.call(child, "sleep", 30, timeout=3)
    assert "Timeout" in e.value.stderr  # faulthandler's stacks, before the kill
    assert "child.py" in e.value.stderr and "in sleep" in e.value.stderr
    assert e.value.stderr.startswith("about to sleep\nTimeout (")


def test_a_missing_function_raises(child):
    with pytest.raises(fresh.FreshProcessError, match="AttributeError"):
        fresh.call(child, "no_such_function")
