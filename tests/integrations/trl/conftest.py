"""What the TRL tests share: sft_script.py's single-process reference beside one ``accelerate launch`` of 4 gloo
processes that runs sft_script.py with mesh_cp and then the TRL example of docs/hf.md (test_doc_example.py), one
after the other in the same processes (launched_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def trl_runs(tmp_path_factory) -> tuple[tuple[dict, dict], Path]:
    """``((reference, mesh), folder)``: sft_script.py's results by case, and the folder the example wrote to."""
    from tests.integrations.clients import reference_and_mesh
    from tests.integrations.trl.test_doc_example import doc_script
    from tests.integrations.trl.test_trl import SCRIPT

    out = tmp_path_factory.mktemp("trl")
    script = doc_script(out / "doc")
    return reference_and_mesh(SCRIPT, out, port=29632, then=(script,), ports=(29634, 29636)), out / "doc"


@pytest.fixture(scope="package")
def rl_runs(tmp_path_factory) -> tuple[dict, dict]:
    """``(reference, mesh)``: rl_script.py's results by case (``module:name``; ``@dp<D>xcp<C>`` under mesh_cp), the
    single process's beside one ``accelerate launch`` of 4 processes running every case at both layouts."""
    from tests.integrations.clients import reference_and_mesh

    script = Path(__file__).with_name("rl_script.py")
    return reference_and_mesh(script, tmp_path_factory.mktemp("rl"), port=29642)
