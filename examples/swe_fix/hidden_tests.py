"""The swe_fix task's hidden tests, run by the judge in a fork of the episode's sandbox (never seen by the agent).

The cases and their expected values come on stdin (not on disk, where the graded code could read them):
``{"target": name, "cases": [[args, expected], ...], "others": {name: [[args, expected], ...]}, "timeout_s": s}``.
The repository's package runs in a child process that only reports return values, so printing a fake report
cannot pass. Score: the target function's cases passed, or 0 when the change broke another function. The last
line is the report the judge reads (``RLBUS-TESTS {"passed": p, "total": t, ...}``).
"""

import json
import subprocess
import sys

MARK = "RLBUS-CHILD-RESULT "
CHILD = """
import json, sys
spec = json.loads(sys.stdin.read())
def encode(v):
    try:
        return {"value": json.loads(json.dumps(v))}
    except (TypeError, ValueError):
        return {"error": "returned a value of type " + type(v).__name__}
out = {}
try:
    import inventory
except BaseException as e:
    print(MARK + json.dumps({"import_error": type(e).__name__ + ": " + str(e)[:200]}))
    sys.exit(0)
for name, calls in spec.items():
    fn = getattr(inventory, name, None)
    out[name] = []
    for args in calls:
        try:
            out[name].append(encode(fn(*args)))
        except BaseException as e:
            out[name].append({"error": type(e).__name__ + ": " + str(e)[:200]})
print(MARK + json.dumps(out))
""".replace("MARK", repr(MARK))


def same(got, expected):
    if isinstance(expected, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and abs(got - expected) <= 1e-6 * max(1.0, abs(expected))
    return got == expected


def main():
    spec = json.loads(sys.stdin.read())
    groups = {spec["target"]: spec["cases"], **spec["others"]}
    calls = {name: [args for args, _ in cases] for name, cases in groups.items()}
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(calls), capture_output=True,
                              text=True, timeout=spec["timeout_s"])
        lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
        result = json.loads(lines[-1][len(MARK):]) if lines else {"import_error": "no result: " + proc.stderr[-200:]}
    except subprocess.TimeoutExpired:
        result = {"import_error": f"timed out after {spec['timeout_s']}s"}
    failures, passed, broken = [], 0, []
    if "import_error" in result:
        failures.append(result["import_error"])
    else:
        for name, cases in groups.items():
            for (args, expected), got in zip(cases, result.get(name, []), strict=False):
                ok = "value" in got and same(got["value"], expected)
                if ok and name == spec["target"]:
                    passed += 1
                elif not ok:
                    shown = ", ".join(repr(a) for a in args)
                    (broken if name != spec["target"] else failures).append(
                        f"{name}({shown}) gave {got.get('value', got.get('error'))}, expected {expected!r}")
    if broken:
        failures = ["the change broke " + broken[0], *failures]
        passed = 0
    total = len(spec["cases"])
    print("RLBUS-TESTS " + json.dumps({"passed": passed, "total": total, "failures": failures[:3]}))
    return 0 if passed == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
