"""The measured cost table (tests/costs.py): files costliest first under `--dist loadfile`, tests
that measured SLOW_CPU_S or more marked `slow`, and the table read back from `--cpu-report`."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests import conftest
from tests.costs import DEFAULT_CPU_S, SLOW_CPU_S, order_files_by_cost, parse_report, read_table, write_table
from tests.cpu_report import format_table


class Item:
    """What the hooks read of a pytest item: its node id and its markers."""

    def __init__(self, nodeid: str, *markers: str):
        self.nodeid, self.markers = nodeid, set(markers)

    def add_marker(self, mark) -> None:
        self.markers.add(mark.name)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


COSTS = {"tests/test_a.py::one": 0.1, "tests/test_a.py::two": 0.2, "tests/test_a.py::three": 0.1,
         "tests/test_b.py::heavy": 30.0,
         "tests/test_c.py::x": 2.0, "tests/test_c.py::y": 0.1}


def test_files_come_costliest_first_and_keep_their_tests_order():
    items = [Item(n) for n in COSTS] + [Item("tests/test_new.py::unknown")]  # a file the table lacks
    order_files_by_cost(items, COSTS)
    assert [i.nodeid for i in items] == [
        "tests/test_b.py::heavy",  # 1 test, 30 CPU-s: first, not last (xdist sorts by number of tests)
        "tests/test_c.py::x", "tests/test_c.py::y",  # 2.1
        "tests/test_new.py::unknown",  # DEFAULT_CPU_S
        "tests/test_a.py::one", "tests/test_a.py::two", "tests/test_a.py::three"]  # 3 tests, 0.4 CPU-s
    assert 0.4 < DEFAULT_CPU_S < 2.1


def test_the_hook_marks_measured_tests_slow_and_orders_only_under_xdist(monkeypatch):
    monkeypatch.setattr("tests.costs.read_table", lambda: COSTS)
    option = {"--run-install": True}
    items = [Item(n) for n in COSTS] + [Item("tests/test_a.py::marked", "slow"), Item("tests/test_new.py::unknown")]
    conftest.pytest_collection_modifyitems(SimpleNamespace(getoption=option.get), items)
    assert [i.nodeid for i in items][:3] == ["tests/test_a.py::one", "tests/test_a.py::two", "tests/test_a.py::three"]
    slow = {i.nodeid for i in items if i.get_closest_marker("slow")}
    assert slow == {n for n, s in COSTS.items() if s >= SLOW_CPU_S} | {"tests/test_a.py::marked"}
    assert slow == {"tests/test_b.py::heavy", "tests/test_c.py::x", "tests/test_a.py::marked"}

    worker = SimpleNamespace(getoption=option.get, workerinput={"workerid": "gw0"})
    conftest.pytest_collection_modifyitems(worker, items)
    assert items[0].nodeid == "tests/test_b.py::heavy"


def test_loadfile_hands_out_files_in_collection_order():
    """xdist's scheduler with the suite's hook: the first file goes to the first worker, the
    second to the other, then the next to whichever has two tests or fewer left."""
    from xdist.scheduler import LoadFileScheduling  # the test extra's pytest-xdist, as make test runs it

    option = SimpleNamespace(loadscopereorder=True)
    values = {"dist": "loadfile", "tx": ["2*popen"]}
    config = SimpleNamespace(option=option, getvalue=values.get)
    sched = conftest.pytest_xdist_make_scheduler(config, log=None)
    assert isinstance(sched, LoadFileScheduling) and option.loadscopereorder is False

    items = [Item(n) for n in COSTS]
    order_files_by_cost(items, COSTS)
    collection = [i.nodeid for i in items]
    sent = {}

    class Node:
        shutting_down = False

        def __init__(self, name):
            self.name, self.gateway = name, SimpleNamespace(id=name)

        def send_runtest_some(self, indexes):
            sent.setdefault(self.name, []).extend(collection[i] for i in indexes)

        def shutdown(self):
            self.shutting_down = True

    nodes = [Node("gw0"), Node("gw1")]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    assert sent["gw0"][0] == "tests/test_b.py::heavy" and sent["gw1"][:2] == ["tests/test_c.py::x", "tests/test_c.py::y"]
    assert conftest.pytest_xdist_make_scheduler(SimpleNamespace(option=option, getvalue={"dist": "load"}.get), None) is None


def test_the_table_is_read_back_from_cpu_reports(tmp_path):
    rows = [("tests/test_a.py::t[a b-c]", 1.2, 2.0, 9.0), ("tests/test_b.py::u", 0.04, 0.0, 0.1)]
    report = tmp_path / "r.tsv.gw0"
    report.write_text(format_table(rows) + f"{3.0:8.1f}                   outside tests (start, imports, collection)\n")
    assert parse_report(report.read_text()) == {"tests/test_a.py::t[a b-c]": 3.2, "tests/test_b.py::u": 0.0}
    table = tmp_path / "costs.tsv"
    assert write_table([report], table) == 2
    assert read_table(table) == {"tests/test_a.py::t[a b-c]": 3.2, "tests/test_b.py::u": 0.0}
    # a -m "not slow" run where test_b.py::u paid its module's fixture: each test's most
    quick = tmp_path / "q.tsv.gw1"
    quick.write_text(format_table([("tests/test_b.py::u", 4.0, 1.0, 6.0), ("tests/test_a.py::t[a b-c]", 0.1, 0.0, 0.1)]))
    assert write_table([report, quick], table) == 2
    assert read_table(table) == {"tests/test_a.py::t[a b-c]": 3.2, "tests/test_b.py::u": 5.0}


def test_the_checked_in_table_names_tests_of_the_suite():
    """Rows whose test was renamed or removed count nothing; most rows must still name a test."""
    costs = read_table()
    tests = Path(__file__).parent
    assert len(costs) > 500
    names = [n.split("::")[1].split("[")[0] for n in costs]
    sources = {p.name: p.read_text() for p in tests.glob("test_*.py")}
    found = sum(f"def {name}(" in sources.get(n.split("::")[0].split("/")[-1], "") for name, n in zip(names, costs))
    assert found >= 0.9 * len(costs), f"{found} of {len(costs)} rows name a test: rewrite tests/costs.tsv (tests/costs.py)"
