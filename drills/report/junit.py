"""``junit.xml``: one testcase per check, so CI systems show a drill like any test suite."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import Any


def junit_xml(doc: dict[str, Any]) -> str:
    checks = doc["checks"]
    suite = ET.Element("testsuite", name=f"kvdrill.{doc['run_id']}", tests=str(max(len(checks), 1)),
                       failures=str(sum(c["verdict"] == "fail" for c in checks)),
                       errors=str(sum(c["verdict"] == "error" for c in checks) + (doc["verdict"] in ("error", "aborted") and not checks)),
                       skipped=str(int(doc["verdict"] == "held" and not checks)))
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="scenario", value=doc["scenario"])
    if not checks:  # the drill did not get as far as checking: one case carries why
        case = ET.SubElement(suite, "testcase", classname="kvdrill.drill", name="drill")
        # a held run (`run --hold`) judged nothing on purpose: its faults are another tool's to observe
        ET.SubElement(case, "skipped" if doc["verdict"] == "held" else "error",
                      message=doc["reason"][:500]).text = doc["reason"]
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=f"kvdrill.{doc['scenario']}", name=c["name"])
        if c["verdict"] in ("fail", "error"):
            el = ET.SubElement(case, "failure" if c["verdict"] == "fail" else "error", message=c["summary"][:500])
            el.text = json.dumps(c["evidence"][:10], indent=1)
        else:
            ET.SubElement(case, "system-out").text = c["summary"]
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"
