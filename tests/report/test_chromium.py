"""The report as a browser shows it: headless Chromium decodes every chart and finds ink in it.

Skipped when no ``chromium`` is installed (``.ci/run`` installs it where apt is available; see
docs/report.md for the separate check).
"""

import html
import re
import shutil
import subprocess

import numpy as np
import pytest

from trainfit.report.html import write_report

pytest.importorskip("matplotlib")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")

# Runs in the page after load: draws each chart on a canvas and counts non-white pixels.
PROBE = """<script>
window.addEventListener('load', () => {
  const out = [];
  for (const img of document.querySelectorAll('img.chart')) {
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    const ctx = c.getContext('2d');
    ctx.drawImage(img, 0, 0);
    let ink = 0;
    if (c.width && c.height) {
      const d = ctx.getImageData(0, 0, c.width, c.height).data;
      for (let i = 0; i < d.length; i += 4) if (Math.min(d[i], d[i+1], d[i+2]) < 240) ink++;
    }
    out.push([img.alt, img.complete, img.naturalWidth, img.naturalHeight, ink, img.getBoundingClientRect().width]);
  }
  document.body.setAttribute('data-probe', JSON.stringify(out));
});
</script>"""


def chromium(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-extensions", *args], capture_output=True, text=True, timeout=timeout)


def test_chromium_renders_every_chart_non_empty(run_dir, tmp_path):
    import json

    page = write_report(run_dir)
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    r = chromium("--virtual-time-budget=5000", "--dump-dom", probed.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    found = re.search(r'data-probe="([^"]*)"', r.stdout)
    assert found, "the probe did not run: " + r.stdout[:500]
    charts = json.loads(html.unescape(found.group(1)))
    assert [c[0] for c in charts] == ["loss curve", "loss scale", "memory parts", "step time breakdown"]
    for alt, complete, w, h, ink, shown_w in charts:
        assert complete and w >= 300 and h >= 150, alt  # decoded by the browser
        assert ink > 0.02 * w * h, alt  # not blank
        assert shown_w > 100, alt  # laid out on the page, not collapsed


def test_chromium_screenshot_has_charts_on_it(run_dir, tmp_path):
    Image = pytest.importorskip("PIL.Image")
    page = write_report(run_dir)
    shot = tmp_path / "shot.png"
    r = chromium(f"--screenshot={shot}", "--window-size=1000,1400", "--hide-scrollbars", page.as_uri())
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    px = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    colored = int(((px.max(axis=2) - px.min(axis=2)) > 60).sum())  # chart lines and bars, not black text
    assert colored > 2000
