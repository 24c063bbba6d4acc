"""The defaults the README and docs/ state for config keys equal the shipped config's.

Every "`some.config.key` ... (default V)" in README.md and docs/*.md (V up to the first ``)``, ``,``, ``;``
or ``:``) is compared with the value the app's composed config holds for that key (``null`` for None).
The README once said ``callbacks.guard.check_every_n_steps`` defaults to 1 where the config said 10.
"""

from __future__ import annotations

import re

from omegaconf import OmegaConf

from tests.helpers import ROOT, composed

#: a backticked dotted key, at most a few words, then "(default V"
CLAIM = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)`[^`()]{0,40}\(default ([^),;:]+)")
#: config groups to compose so that their keys exist (callbacks=checkpoint adds the checkpoint callback)
GROUPS = ("callbacks=checkpoint",)


def _claims() -> list[tuple[str, str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = " ".join(path.read_text().split())  # claims wrap across lines
        found += [(path.name, key, value.strip()) for key, value in CLAIM.findall(text)]
    return found


def test_documented_defaults_equal_the_shipped_config():
    cfg = composed(*GROUPS)
    claims = [(doc, key, value) for doc, key, value in _claims() if OmegaConf.select(cfg, key, default="<absent>") != "<absent>"]
    assert any(key == "callbacks.guard.check_every_n_steps" for _, key, _ in claims), claims  # the test sees claims
    wrong = []
    for doc, key, value in claims:
        actual = OmegaConf.select(cfg, key)
        shown = "null" if actual is None else str(actual).lower() if isinstance(actual, bool) else str(actual)
        if shown != value:
            wrong.append(f"{doc}: {key} documented default {value!r}, config has {shown!r}")
    assert not wrong, wrong
