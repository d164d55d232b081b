"""``jaxformer doctor``'s report (tools/doctor/run.py's dict) as text and as report JSON.

    jaxformer doctor on cpu
      devices   1 x cpu (platform cpu)
      versions  jax 0.10.2, jaxlib 0.10.2, optax 0.2.8, Python 3.12.3, jaxformer 0.1.0

    attention kernels vs full attention (...)                             4.1 s
      pallas compiled kernels           not checked: no GPU/TPU (...)
      pallas float32 (interpret mode)   passed: worst rel 2.4e-07 (dk) <= 1e-05
      ...

    doctor: 8 checks passed, 0 failed, 3 not checked on cpu
"""

from __future__ import annotations

from pathlib import Path

from jaxformer.observe.jsonsafe import write_json

NAME_WIDTH = 40  # the check names' column


def _header_lines(head: dict) -> list[str]:
    kind = head["device_kind"] if isinstance(head["device_kind"], str) else ", ".join(head["device_kind"])
    runtime = f", {head['runtime']}" if head.get("runtime") and head["platform"] != "cpu" else ""
    on = "; the checks run on device 0" if head["device_count"] > 1 else ""
    return [f"jaxformer doctor on {head['platform']}",
            f"  devices   {head['device_count']} x {kind} (platform {head['platform']}{runtime}{on})",
            f"  versions  jax {head['jax']}, jaxlib {head['jaxlib']}, optax {head['optax']}, "
            f"Python {head['python']}, jaxformer {head['jaxformer']}"]


def _peak_line(peak: dict) -> str:
    if not peak.get("flops_per_s"):
        return f"  MFU peak: none ({peak.get('source')})"
    return f"  MFU peak: {peak['flops_per_s'] / 1e9:,.1f} GFLOP/s {peak['dtype']}, {peak['source']}"


def format_text(report: dict) -> str:
    """The report as the terminal shows it: header, one block per section (its heading and
    time, one line per check), the verdict last."""
    lines = _header_lines(report["header"])
    for section in report["sections"]:
        lines += ["", f"{section['title']}  [{section['seconds']:.1f} s]"]
        for c in report["checks"]:
            if c["group"] == section["group"]:
                lines.append(f"  {c['name']:<{NAME_WIDTH}} {c['status']}: {c['detail']}")
        if "peak" in section:
            lines.append(_peak_line(section["peak"]))
    lines += ["", report["summary"]["verdict"]]
    return "\n".join(lines)


def write_report(report: dict, path) -> Path:
    """The report as JSON at ``path`` (its folder made); returns the path. NaN and infinity
    become null (their text is in the check's detail)."""
    return write_json(path, report, indent=1, non_finite="null")
