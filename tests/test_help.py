"""`--help` of `python -m scaffold.train` and `python -m scaffold.data`: pages generated from the schema's
field docstrings, in place of Hydra's stock page."""
from __future__ import annotations

import inspect
import re
import string

from omegaconf import OmegaConf

from scaffold import config
from scaffold.help import escape, sections
from tests.helpers import cli


def _flat(text: str) -> str:
    """Whitespace collapsed: the page re-wraps docstrings to its own width."""
    return " ".join(text.split())


def _listed(page: str) -> set[str]:
    return set(re.findall(r"^  (\S+): ", page, flags=re.M))


def test_every_key_has_its_docstring_from_the_source():
    keys = [k for s in sections() for k in s.keys]
    source = _flat(inspect.getsource(config))
    assert {"scale", "data.cache_dir", "ladder.conv", "parallel.timeout_s"} <= {k.name for k in keys}
    for k in keys:
        assert k.doc, f"{k.name} has no docstring in scaffold/config.py"
        assert _flat(k.doc) in source, k.name  # read from config.py, not made up
    assert not set(config.RETIRED) & {k.name for k in keys}


def test_train_help_shows_field_docstrings(tmp_path):
    r = cli("--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    page = r.stdout
    assert "python -m scaffold.train" in page and "resume=" in page and "--hydra-help" in page
    assert "powered by hydra" not in page.lower()
    assert "more_determinism" not in page
    keys = [k for s in sections() for k in s.keys]
    assert {"data.cache_dir", "ladder.conv", "optim.eta_min"} <= _listed(page)
    assert _listed(page) == {k.name for k in keys}
    for k in keys:
        assert _flat(k.doc) in _flat(page), k.name
    assert list(tmp_path.iterdir()) == []  # no outputs/, no .hydra/, no log


def test_data_help_lists_only_the_dataset_keys(tmp_path):
    r = cli("--help", cwd=tmp_path, module="scaffold.data")
    assert r.returncode == 0, r.stderr
    page = r.stdout
    listed = _listed(page)
    assert {"scale", "seed", "data.n_categories", "data.variance_threshold"} <= listed
    assert "lr" not in listed and "epochs" not in listed
    assert "ladder.conv" not in page
    assert "powered by hydra" not in page.lower()
    assert list(tmp_path.iterdir()) == []


def test_escaped_text_survives_hydra_help_template():
    # Hydra resolves the template with OmegaConf (${...}), then string.Template ($NAME, $$).
    for text in ["costs $5", "${hydra.job.name} and $FLAGS_HELP", "a \\${b} $$ $", "plain"]:
        node = OmegaConf.create({"template": escape(text)})
        assert string.Template(node.template).substitute(FLAGS_HELP="x") == text
