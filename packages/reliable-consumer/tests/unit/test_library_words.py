"""The library speaks of records, keys and the service's own names, never of the example's.

A team whose service grants nothing must not read "payments" in its operator tools, demo
or errors: the payments example is the template's own service (service/ at the
repository's root), and the library reaches it only through the app declaration. Each
remaining mention is listed here with the reason it stays.
"""

from __future__ import annotations

import re
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "src" / "reliable_consumer"
WORD = re.compile("payment", re.IGNORECASE)

# (file under reliable_consumer/, text on the line): why the mention stays.
STAYS = {
    ("engine/handlers/redaction.py", "card number"): (
        "what redaction hides is any service's payment card numbers (the Luhn check), not "
        "the example's data"
    ),
    ("dev/from_copy.py", "payments.py"): (
        "the migration from a copied engine recognises the old template's example handler "
        "files by name, to leave them out of what it keeps as the team's"
    ),
    ("dev/servers/apache_kafka.pom.xml", "<groupId>"): (
        "the local pom's coordinate: its digest keys every machine's cache of the broker's "
        "jars, so renaming it would fetch them all again for no reader's gain"
    ),
}


def test_the_library_names_no_payment_but_where_a_listed_reason_says_why() -> None:
    unexplained = []
    explained = set()
    for path in sorted(p for p in LIBRARY.rglob("*") if p.is_file() and p.suffix != ".pyc"):
        relative = path.relative_to(LIBRARY).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if not WORD.search(line):
                continue
            reason = next((k for k in STAYS if k[0] == relative and k[1] in line), None)
            if reason is None:
                unexplained.append(f"{relative}:{number}: {line.strip()}")
            else:
                explained.add(reason)
    assert not unexplained, "\n".join(unexplained)
    assert explained == set(STAYS), f"reasons for lines that are gone: {set(STAYS) - explained}"
