"""The figures of one `make coverage` run (.ci/coverage.sh calls it): each target's wall time and
the total (from the table .ci/run prints), line coverage of moe_rl/ by everything and by
`make test` alone, and every test's duration per target (pytest's --durations=0 sections).
Writes DIR/summary.json and DIR/durations.tsv; `compare BEFORE AFTER` prints two summaries as
a markdown table. From the per-test contexts (.coveragerc): `unique DIR [TEXT]` prints how many
lines only one test covers (tests whose id holds TEXT), `without DIR IDS_FILE` the coverage of
.ci/run with the tests listed in IDS_FILE taken out and the lines that would go."""
import json
import pathlib
import re
import sys


def target_times(log: str) -> dict:
    table = log.rsplit("== .ci/run wall time per target (s) ==", 1)[-1]
    return {name: int(s) for name, s in re.findall(r"^([a-z-]+) (\d+)$", table, re.M)}


# a pytest command's marker expression -> its target (for logs of a .ci/run that did not
# announce its targets)
MARKERS = {'"not slow and not contract and not multinode and not loop and not cluster and not '
           'sglang"': "test", '"loop and not slow and not sglang"': "test-loop",
           "-m multinode": "test-multinode", "-m cluster": "test-cluster",
           "-m contract": "test-contract", '"sglang and not slow"': "test-sglang",
           '"not slow and (not loop or upstream)"': "test-upstream"}


def durations(log: str) -> list[tuple[str, str, float, str]]:
    """(target, phase, seconds, test id) of every line in every durations section, the target
    being the last one .ci/run announced (or whose pytest command ran) before it."""
    rows, target = [], "?"
    for line in log.splitlines():
        start = re.match(r"^\.ci/run target: ([a-z-]+)$", line)
        if start:
            target = start.group(1)
        elif " -m pytest " in line:
            target = next((t for marker, t in MARKERS.items() if marker in line), target)
        m = re.match(r"^([0-9.]+)s (setup|call|teardown) +(\S+)", line)
        if m:
            rows.append((target, m.group(2), float(m.group(1)), m.group(3)))
    return rows


def percent(report: pathlib.Path) -> float:
    totals = json.loads(report.read_text())["totals"]
    return round(totals["percent_covered"], 2)


def main(folder: str) -> None:
    d = pathlib.Path(folder)
    log = (d / "ci.log").read_text(errors="replace")
    summary = {"targets_s": target_times(log),
               "coverage_percent": {"ci_run": percent(d / "all.json"),
                                    "make_test": percent(d / "test.json")}}
    summary["total_s"] = summary["targets_s"].pop("total", None)
    (d / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    rows = sorted(durations(log), key=lambda r: -r[2])
    (d / "durations.tsv").write_text("target\tphase\tseconds\ttest\n" + "".join(
        f"{t}\t{p}\t{s:.2f}\t{i}\n" for t, p, s, i in rows))
    print(json.dumps(summary, indent=1))


def compare(before: str, after: str) -> str:
    """A markdown table of two summary.json files (per target, total, coverage)."""
    b, a = (json.loads(pathlib.Path(x).read_text()) for x in (before, after))
    names = list(dict.fromkeys([*b["targets_s"], *a["targets_s"]]))
    rows = ["| | before (s) | after (s) |", "|---|---:|---:|"]
    rows += [f"| {n} | {b['targets_s'].get(n, '')} | {a['targets_s'].get(n, '')} |" for n in names]
    rows.append(f"| **total** | **{b['total_s']}** | **{a['total_s']}** |")
    for key, label in (("ci_run", "line coverage of moe_rl/ by .ci/run"),
                       ("make_test", "line coverage of moe_rl/ by make test")):
        rows.append(f"| {label} | {b['coverage_percent'][key]} % | "
                    f"{a['coverage_percent'][key]} % |")
    return "\n".join(rows) + "\n"


def lines_by_test(folder: str) -> tuple[dict, int]:
    """{(file, line): set of test ids} over everything .ci/run measured, and the number of
    statements; a line run outside any test (set-up, the environments' builds) has the id ''.
    A forked rank's context is 'its server's test|its own test': the last part counts."""
    import coverage
    d = pathlib.Path(folder)
    data = coverage.CoverageData(basename=str(d / "all.combined"))
    data.read()
    report = json.loads((d / "all.json").read_text())
    # the lines coverage's report counts (statements; the tracer also records others)
    counted = {f: set(v["executed_lines"]) for f, v in report["files"].items()}
    by_line = {}
    for path in data.measured_files():
        if "moe_rl/" not in path:   # configs/__init__.py (the wheel's copy of the configs)
            continue
        rel = path[path.rindex("moe_rl/"):]
        for line, contexts in data.contexts_by_lineno(path).items():
            if line in counted.get(rel, ()):
                by_line.setdefault((rel, line), set()).update(c.split("|")[-1]
                                                              for c in contexts)
    return by_line, report["totals"]["num_statements"]


def unique(folder: str, text: str = "") -> str:
    by_line, _ = lines_by_test(folder)
    only = {}
    for key, tests in by_line.items():
        if len(tests) == 1:
            only.setdefault(next(iter(tests)), []).append(key)
    rows = sorted(((len(v), t) for t, v in only.items() if t and text in t), reverse=True)
    return "".join(f"{n}\t{t}\n" for n, t in rows)


def without(folder: str, ids_file: str) -> str:
    by_line, statements = lines_by_test(folder)
    gone = set(pathlib.Path(ids_file).read_text().split())
    lost = sorted(key for key, tests in by_line.items() if not tests - gone)
    covered = len(by_line)
    out = [f"{key[0]}:{key[1]}" for key in lost]
    out.append(f"covered {covered} of {statements} ({100 * covered / statements:.2f} %); "
               f"without the {len(gone)} tests {covered - len(lost)} "
               f"({100 * (covered - len(lost)) / statements:.2f} %)")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        print(compare(sys.argv[2], sys.argv[3]), end="")
    elif sys.argv[1] == "unique":
        print(unique(*sys.argv[2:]), end="")
    elif sys.argv[1] == "without":
        print(without(sys.argv[2], sys.argv[3]), end="")
    else:
        main(sys.argv[1])
