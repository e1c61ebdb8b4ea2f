#!/usr/bin/env python3
"""Mutation testing: does the suite notice when the code is wrong?

Each line of tests/mutations.tsv names a one-line change to the source (a
dropped term, an off-by-one, a flipped sign).  For each, in a scratch copy
of the tracked files: apply it, rebuild (incrementally), run the tests its
line names, and record whether a test failed (the mutation is *killed*) or
everything passed (it *survived*: a hole in the suite).  The source tree is
never touched.

    python3 scripts/mutate.py              every mutation
    python3 scripts/mutate.py dropout      those whose name contains it
    python3 scripts/mutate.py --list       the list only

Exit status: 0 when every mutation was killed, 1 when one survived, 2 when
the unmutated tree fails its own tests or a mutation does not apply.
Run it before calling an issue resolved; docs/TESTING.md records the last
result and explains any survivor.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIST = os.path.join(ROOT, "tests", "mutations.tsv")
JOBS = str(os.cpu_count() or 2)


def load():
    muts = []
    with open(LIST, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            parts = line.split("\t")
            if len(parts) != 5:
                sys.exit(f"{LIST}:{n}: expected 5 tab-separated fields, "
                         f"got {len(parts)}")
            name, path, regex, old, new = parts
            muts.append(dict(name=name, path=path, regex=regex,
                             old=old.replace("\\n", "\n"),
                             new=new.replace("\\n", "\n"), line=n))
    return muts


def run(cmd, cwd, log, timeout=1800):
    with open(log, "w") as out:
        try:
            return subprocess.run(cmd, cwd=cwd, stdout=out,
                                  stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def main(argv):
    muts = load()
    if "--list" in argv:
        for m in muts:
            print(f"{m['name']}  ({m['path']}; tests {m['regex']})")
        return 0
    wanted = [a for a in argv if not a.startswith("-")]
    if wanted:
        muts = [m for m in muts if any(w in m["name"] for w in wanted)]
    # Every mutation must apply to exactly one place, checked before any
    # build: a list that has fallen behind the code says so at once.
    stale = []
    for m in muts:
        with open(os.path.join(ROOT, m["path"]), encoding="utf-8") as f:
            n = f.read().count(m["old"])
        if n != 1:
            stale.append(f"line {m['line']}: '{m['name']}': the text occurs "
                         f"{n} times in {m['path']}")
    if stale:
        print("\n".join(stale))
        return 2
    scratch = tempfile.mkdtemp(prefix="mha-mutate.")
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT,
                               check=True, capture_output=True).stdout
        for rel in files.decode().split("\0"):
            if rel and os.path.isfile(os.path.join(ROOT, rel)):
                dst = os.path.join(scratch, rel)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, rel), dst)
        # The Python tests on the tree's files (tests/pytest_source.sh)
        # run over the extension installed in the repository's .venv;
        # without it they skip, and a Python mutation would "survive".
        venv = os.path.join(ROOT, ".venv")
        if os.path.isdir(venv):
            os.symlink(venv, os.path.join(scratch, ".venv"))
        build = os.path.join(scratch, "build")
        log = os.path.join(scratch, "log.txt")
        print(f"scratch copy in {scratch}; configuring and building")
        if (run(["cmake", "-S", scratch, "-B", build,
                 "-DCMAKE_BUILD_TYPE=Release"], scratch, log) or
                run(["cmake", "--build", build, "-j", JOBS], scratch, log)):
            print(open(log).read()[-3000:])
            return 2
        # The unmutated tree must pass what the mutations will run.
        union = "|".join(sorted({m["regex"] for m in muts}))
        if run(["ctest", "--test-dir", build, "-R", union], scratch, log):
            print("the unmutated tree fails its tests:")
            print(open(log).read()[-3000:])
            return 2
        results = []
        for m in muts:
            src = os.path.join(scratch, m["path"])
            text = open(src, encoding="utf-8").read()
            if text.count(m["old"]) != 1:
                print(f"line {m['line']}: '{m['name']}': the text to mutate "
                      f"occurs {text.count(m['old'])} times in {m['path']}")
                return 2
            t0 = time.time()
            with open(src, "w", encoding="utf-8") as f:
                f.write(text.replace(m["old"], m["new"]))
            try:
                if run(["cmake", "--build", build, "-j", JOBS], scratch, log):
                    verdict = "killed (does not build)"
                elif run(["ctest", "--test-dir", build, "-R", m["regex"]],
                         scratch, log):
                    failed = [l.strip() for l in open(log)
                              if "***Failed" in l or "(Failed)" in l]
                    verdict = "killed" + (f" by {failed[0].split()[3]}"
                                          if failed and
                                          len(failed[0].split()) > 3 else "")
                else:
                    verdict = "SURVIVED"
            finally:
                with open(src, "w", encoding="utf-8") as f:
                    f.write(text)
            results.append((m["name"], verdict))
            print(f"{verdict:32s} {m['name']}  ({time.time() - t0:.0f} s)",
                  flush=True)
        killed = sum(1 for _, v in results if v != "SURVIVED")
        print(f"\n{killed} of {len(results)} mutations killed "
              f"({100.0 * killed / max(1, len(results)):.0f}%)")
        return 0 if killed == len(results) else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
