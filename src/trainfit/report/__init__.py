"""The HTML report of a run directory (``trainfit report RUN_DIR``)."""

from trainfit.report.html import render, write_report

__all__ = ["render", "write_report"]
