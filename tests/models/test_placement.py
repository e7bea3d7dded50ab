"""Where and in which precision a model runs: the verifier's and drafters' device and dtype settings
(CPU float32 by default; the CPU path of the switch is what this host can test)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from sdcp.config import ConfigError, load_config
from sdcp.models import LoadedModel, TargetModel
from sdcp.models.errors import ModelError
from sdcp.models.registry import load_drafter, load_target, torch_placement

pytestmark = pytest.mark.timeout(120)


def test_a_bfloat16_target_scores_as_the_bfloat16_model_decodes(tiny_loaded: LoadedModel) -> None:
    target = load_target("tiny", device="cpu", dtype="bfloat16")
    assert {p.dtype for p in target.model.parameters()} == {torch.bfloat16}
    reference = copy.deepcopy(tiny_loaded.model).to(torch.bfloat16)
    prompt = [5, 6, 7, 8, 9]
    with torch.inference_mode():
        generated = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
        )[0, len(prompt) :].tolist()
    session = b"\x01" * 16
    target.open_session(session, prompt)
    decoded: list[int] = []
    for _ in range(8):
        row = target.score([(session, ())])[0]
        assert row.dtype == np.float32  # logits leave the model as float32, whatever it runs in
        token = int(row[0].argmax())
        target.commit(session, 0, [token])
        decoded.append(token)
    assert decoded == generated
    # The weights digest covers the dtype: a bf16 verifier is another target than an fp32 one.
    assert target.weights_digest != TargetModel(tiny_loaded.model, name="tiny").weights_digest


def test_a_bfloat16_target_exports_float32_kv_that_an_fp32_host_format_reads() -> None:
    target = load_target("tiny", dtype="bfloat16")
    session = b"\x02" * 16
    target.open_session(session, [1, 2, 3, 4])
    blob = target.export_kv(session)
    again = load_target("tiny", dtype="bfloat16")
    again.import_kv(session, blob, target.committed_tokens(session))
    for (k1, v1), (k2, v2) in zip(again.session_kv(session), target.session_kv(session), strict=True):
        assert k1.dtype == torch.bfloat16 and torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_model_drafter_runs_in_the_configured_dtype() -> None:
    drafter = load_drafter("hf:tiny-draft", vocab_size=257, dtype="bfloat16")
    assert {p.dtype for p in drafter.model.parameters()} == {torch.bfloat16}  # type: ignore[attr-defined]


def test_a_device_this_host_lacks_is_one_line() -> None:
    if torch.cuda.is_available():
        assert torch_placement("cuda", "bfloat16") == (torch.device("cuda"), torch.bfloat16)
    else:
        with pytest.raises(ModelError, match="'cuda' is not available on this host"):
            torch_placement("cuda", "bfloat16")
    with pytest.raises(ModelError, match="'cuda:99' is not available"):
        torch_placement("cuda:99", "float32")


@pytest.mark.parametrize(("line", "key"), [("device = 'gpu'", "verifier.device"), ("dtype = 'fp8'", "verifier.dtype")])
def test_device_and_dtype_keys_are_checked(tmp_path: Path, line: str, key: str) -> None:
    path = tmp_path / "verifier.toml"
    path.write_text(
        '[instance]\nuri = "https://127.0.0.1:9101"\ncert = "a.pem"\nkey = "a.key"\nca = "ca.pem"\n'
        f"\n[verifier]\n{line}\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=key):
        load_config(path)
