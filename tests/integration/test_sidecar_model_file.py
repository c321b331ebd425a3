"""A length model mounted from a ConfigMap (``spec.predictor.model``): the sidecar the
operator configures with ``warmStart`` + ``warmStartOptional`` starts cold when the file
is missing (one warning, ``binbatch_predictor_model_loaded`` 0) and swaps the model in
when the file appears; started with the file, it predicts from it.  Real gRPC on
127.0.0.1 in front of the engine emulator; each model check is one ``check_model()``
(what the poll loop calls), so nothing sleeps."""

from __future__ import annotations

import logging

from sidecar_harness import running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.core import length_model
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator
from binbatch_sidecar.engine.model_file import save_model

FAST = EmulatorConfig(step_a=0.0005, step_c=0.0001, num_gpu_blocks=512, block_size=16)
LONG, SHORT = "write a long essay about thing {}", "yes or no: is thing {} blue?"
CAP = 600  # max_tokens: what a cold predictor expects with no history (it is above every model prediction here)


def _model(path) -> None:
    prompts = [(LONG if i % 2 else SHORT).format(i) for i in range(40)]
    save_model(path, length_model.fit([length_model.featurize(p) for p in prompts],
                                      [400.0 if i % 2 else 3.0 for i in range(40)]))  # fmt: skip


def _config(url: str, path) -> dict:
    return sidecar_config(url, predictor={"kind": "Learned", "warmStart": str(path), "warmStartOptional": True})


async def _predicted(sc, prompt: str) -> float:
    resp = await sc.inference.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=CAP, ignore_eos=True), timeout=30)
    assert resp.completion_tokens == CAP
    return resp.predicted_output_tokens


async def _loaded(sc) -> float:
    [sample] = (await sc.scrape())["binbatch_predictor_model_loaded"].samples
    return sample.value


async def test_a_missing_mounted_model_starts_cold_says_so_and_is_loaded_when_it_appears(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="binbatch")
    path = tmp_path / "model" / "model.npz"  # the volume of a ConfigMap not created yet: nothing there
    async with running_emulator(FAST) as url, running_sidecar(_config(url, path), tmp_path) as sc:
        assert await _loaded(sc) == 0
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and "spec.predictor.model" in warned[0] and str(path) in warned[0]
        assert await _predicted(sc, LONG.format(101)) == CAP  # cold: no model reads the prompt
        assert not sc.sidecar.check_model()  # still missing: nothing to do, and no second warning
        assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
        path.parent.mkdir()
        _model(path)  # kubelet fills the volume once the ConfigMap exists
        assert sc.sidecar.check_model()
        assert await _loaded(sc) == 1
        long, short = await _predicted(sc, LONG.format(102)), await _predicted(sc, SHORT.format(102))
        assert long > 5 * short and long < CAP
        assert not sc.sidecar.check_model()  # unchanged file: the running model stays


async def test_a_sidecar_started_with_its_model_file_predicts_from_it(tmp_path):
    path = tmp_path / "model.npz"
    _model(path)
    async with running_emulator(FAST) as url, running_sidecar(_config(url, path), tmp_path) as sc:
        assert await _loaded(sc) == 1
        long, short = await _predicted(sc, LONG.format(7)), await _predicted(sc, SHORT.format(7))
        assert long > 5 * short
