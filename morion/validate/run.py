"""`morion validate`: reach the server, check every suite can run, run them in order, write the files.

The JSON is rewritten after every suite (status "partial"), so a run stopped early keeps its evidence.
Exit status 1 when any suite fails; "unsupported" (a server without tool calling) is not a failure, and
not a pass either: the overall verdict is then "unsupported".
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

from morion.bench import provenance
from morion.bench.plot import matplotlib_available
from morion.bench.report import output_paths, slug, write_json
from morion.errors import MorionError
from morion.validate import cases as case_files
from morion.validate import needle, perf, restore, soak, tools, vision
from morion.validate.options import ValidateOptions, command_line
from morion.validate.plot import write_pngs
from morion.validate.report import markdown
from morion.validate.session import Session

SCHEMA = "morion-validate/1"
_SUITES = {"needle": needle, "restore": restore, "soak": soak, "perf": perf, "tools": tools, "vision": vision}
_CASE_LISTS = {
    "needle": "cases",
    "restore": "cases",
    "soak": "conversations",
    "tools": "cases",
    "vision": "cases",
}


def run_validate(args: argparse.Namespace) -> int:
    options = ValidateOptions.from_args(args)
    _check_case_ids(options)
    session = Session(options)
    for name in options.suites:
        check = getattr(_SUITES[name], "check", None)
        if check is not None:
            check(session)  # every suite's settings are checked before the first one runs
    prov = provenance.collect(command_line(args))
    label = slug(f"validate-{options.label or session.model}")
    path = output_paths(Path(options.out), prov["date"], label)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "label": label,
        "date": prov["date"],
        "status": "partial",
        "verdict": None,
        "provenance": prov,
        "server": session.identity(),
        "settings": options.settings(),
        "suites": {},
    }
    session.say(f"writing {path}")
    beside = options.soak_during_restore and {"restore", "soak"} <= set(options.suites)
    try:
        for name in options.suites:
            if beside and name == "soak":
                continue  # it ran beside restore
            session.say(f"suite {name}" + (" with soak beside it" if beside and name == "restore" else ""))
            if beside and name == "restore":
                result["suites"]["restore"], result["suites"]["soak"] = _restore_beside_soak(session)
            else:
                result["suites"][name] = _SUITES[name].run(session)
            write_json(path, result)
    except BaseException:
        _write_all(path, result)  # the suites that finished, marked partial
        raise
    verdicts = {suite["verdict"] for suite in result["suites"].values()}
    failed = "fail" in verdicts
    result["verdict"] = "fail" if failed else "unsupported" if "unsupported" in verdicts else "pass"
    result["status"] = "complete"
    _write_all(path, result)
    return 1 if failed else 0


def _restore_beside_soak(session: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    """restore while soak's clients run (the other traffic a restore must be immune to). The soak ends
    before any `--restart-cmd` (its clients would see the restart as errors); its end (memory, pages held
    when idle) is measured once restore's traffic before the restart is over, when the server is idle."""
    outcome: dict[str, Any] = {}
    restore_traffic_over = threading.Event()  # soak measures its end (memory, idle) after it

    def soak_thread() -> None:
        try:
            outcome["soak"] = soak.run(
                session, idle_wait_s=session.options.request_timeout_s, before_end=restore_traffic_over.wait
            )
        except BaseException as error:  # re-raised in the main thread
            outcome["error"] = error

    def before_restart() -> None:
        restore_traffic_over.set()
        thread.join()

    thread = threading.Thread(target=soak_thread, name="validate-soak")
    thread.start()
    try:
        restored = restore.run(session, before_restart=before_restart)
    finally:
        restore_traffic_over.set()
        thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return restored, outcome["soak"]


def _check_case_ids(options: ValidateOptions) -> None:
    if not options.cases:
        return
    known = {
        case["id"]
        for name in options.suites
        if name in _CASE_LISTS
        for case in case_files.load(name).data[_CASE_LISTS[name]]
    }
    unknown = [case for case in options.cases if case not in known]
    if unknown:
        raise MorionError(f"--cases names no case of the chosen suites: {', '.join(unknown)}")


def _write_all(path: Path, result: dict[str, Any]) -> None:
    write_json(path, result)
    stem = path.with_suffix("")
    images = write_pngs(result, stem)
    md_path = path.with_suffix(".md")
    md_path.write_text(markdown(result, images))
    print("\n".join([str(path), str(md_path), *(str(path.with_name(name)) for name in images.values())]))
    if not matplotlib_available():
        print("morion validate: no plots (matplotlib is not installed here)", file=sys.stderr)
