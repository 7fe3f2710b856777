"""pytest setup for the Python suite: the measured-error log (FLASHGDN_ERROR_LOG)."""
import json
import os


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FLASHGDN_ERROR_LOG")
    if not path:
        return
    try:
        from gdn_testutil import ERROR_RECORDS
    except ImportError:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(ERROR_RECORDS, f, indent=1)
