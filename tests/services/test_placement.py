"""``--device`` / ``--dtype`` of the services: flags beat ``LYANNA_VERIFIER_*`` /
``LYANNA_DRAFTER_*`` beat the CPU float32 default, bad values are refused at start-up, and a
verifier + drafter pair running a tiny model in bfloat16 decodes exactly what the in-process
plain decoder decodes in bfloat16 (greedy) and what the in-process engine draws (seeded
sampling). A smoke test runs the engine and a verifier servicer in bf16 on the CPU and on a
GPU (that case skips without one)."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import torch

from lyanna.decode import generate
from lyanna.drafters import DraftBudget, make_drafter
from lyanna.drafters.ngram import NgramDrafter
from lyanna.engine import EngineConfig, SpecEngine
from lyanna.model import load_model
from lyanna.model.device import parse_device, parse_dtype, parse_placement
from lyanna.sampling import SamplingParams
from lyanna.sequence import Sequence
from lyanna.target import TargetConfig, TargetRunner
from lyanna.tree import TokenTree
from services import codec
from services.config import ServerConfig, parse_configs
from services.drafter.server import DrafterConfig
from services.hidden import HiddenSender
from services.launch import launch
from services.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from services.verifier.config import VerifierConfig
from services.verifier.server import VerifierServicer
from tests.conftest import make_tiny_model
from tests.services.remote_client import PROMPTS, engine_outputs, plain_greedy, run_remote
from tests.services.test_remote import BUDGET, LYANNA_FLAGS, MAX_TOKENS, config_for
from tests.services.test_servicers import FakeContext
from tests.services.tiny_drafters import tiny_lyanna

NO_CUDA = not torch.cuda.is_available()


def test_dtype_and_device_names() -> None:
    assert parse_dtype("bf16") is parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("FP16") is parse_dtype("float16") is torch.float16
    assert parse_dtype("float32") is parse_dtype("fp32") is torch.float32
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        parse_dtype("int8")
    for name in ("tpu", "cuda:x", ""):
        with pytest.raises(ValueError, match="device"):
            parse_device(name)
    with pytest.raises(ValueError, match="CPU in float32 only"):
        parse_placement("cpu", "bf16", "q4")
    assert parse_placement("cpu", "bf16", "auto") == (torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"needs CUDA.*--device cpu"):
        parse_device("cuda")
    assert parse_device("cuda:1", usable_here=False) == torch.device("cuda:1")  # a relay's
    with pytest.raises(SystemExit):
        parse_configs((ServerConfig, VerifierConfig), ["--device", "cuda"], "LYANNA_VERIFIER_", {})


def test_placement_flags_over_environment_over_defaults() -> None:
    _, verifier = parse_configs((ServerConfig, VerifierConfig), [], "LYANNA_VERIFIER_", {})
    assert (verifier.device, verifier.dtype, verifier.torch_dtype) == (
        "cpu",
        "float32",
        torch.float32,
    )
    env = {"LYANNA_VERIFIER_DTYPE": "bf16", "LYANNA_VERIFIER_DEVICE": "cpu"}
    _, verifier = parse_configs((ServerConfig, VerifierConfig), [], "LYANNA_VERIFIER_", env)
    assert verifier.torch_dtype is torch.bfloat16
    _, verifier = parse_configs(
        (ServerConfig, VerifierConfig), ["--dtype", "float16"], "LYANNA_VERIFIER_", env
    )
    assert verifier.torch_dtype is torch.float16  # the flag wins
    env = {"LYANNA_DRAFTER_DTYPE": "bfloat16", "LYANNA_DRAFTER_METHOD": "ngram"}
    _, drafter = parse_configs((ServerConfig, DrafterConfig), [], "LYANNA_DRAFTER_", env)
    assert (drafter.device, drafter.torch_dtype) == ("cpu", torch.bfloat16)


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtype", "int8"],
        ["--device", "tpu"],
        ["--weights", "q4", "--dtype", "bf16"],  # 4-bit weights: CPU float32 only
    ],
)
@pytest.mark.parametrize(
    "classes, prefix",
    [
        ((ServerConfig, VerifierConfig), "LYANNA_VERIFIER_"),
        ((ServerConfig, DrafterConfig), "LYANNA_DRAFTER_"),
    ],
)
def test_bad_placements_are_refused_at_start_up(argv, classes, prefix) -> None:
    with pytest.raises(SystemExit):
        parse_configs(classes, argv, prefix, {})


def test_q4_weights_off_cpu_float32_fail_before_loading(tmp_path) -> None:
    with pytest.raises(ValueError, match="CPU in float32 only"):
        load_model(tmp_path / "missing", torch.bfloat16, weights="q4")  # before any read


def test_bf16_model_keeps_its_kv_cache_and_hidden_rows_in_bf16(tiny_model_dir) -> None:
    """``auto`` weights in bf16 load dense; the KV cache and the hidden rows a verification
    returns (and sends over the wire) are bf16 as well."""
    model = load_model(tiny_model_dir, torch.bfloat16, weights="auto")
    assert model.dtype is torch.bfloat16 and model.native is None
    runner = TargetRunner(model, TargetConfig(max_running=1, max_len=64))
    assert runner.cache.keys.dtype is torch.bfloat16
    servicer = VerifierServicer(runner, VerifierConfig(max_tree_nodes=8), HiddenSender())
    item = verifier_pb2.PrefillItem(seq_id=1, prompt_ids=[1, 2, 3], return_hidden=True)
    item.params.max_tokens = 4
    result = servicer.Prefill(verifier_pb2.PrefillRequest(items=[item]), FakeContext()).results[0]
    assert result.prompt_hidden.tensor.dtype == "bfloat16"
    assert list(result.prompt_hidden.tensor.shape) == [3, model.config.hidden_size]
    capacity = servicer.Capacity(verifier_pb2.CapacityRequest(), FakeContext())
    assert capacity.hidden_dtype == "bfloat16"


def test_cpu_only_drafters_refuse_a_target_off_the_cpu() -> None:
    """Only the model-free methods, EAGLE-2 and Lyanna draft next to a target on another
    device (a GPU; the meta device stands in for it here): SPS says so when built."""
    model = make_tiny_model(2, vocab_size=16).to("meta")
    with pytest.raises(ValueError, match="CPU only"):
        make_drafter("sps", model, DraftBudget(4, 2, 6))
    assert isinstance(make_drafter("ngram", model, DraftBudget(4, 2, 6)), NgramDrafter)


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model_dir):
    """The exported tiny model as a ``--dtype bf16`` service loads it."""
    return load_model(tiny_model_dir, torch.bfloat16)


def test_bf16_services_equal_bf16_plain_decoding_and_engine(
    tiny_model_dir, tiny_bf16, tiny_loaded
) -> None:
    """The verifier takes its dtype from the environment, the drafter from its flag. Greedy
    output is plain bf16 decoding's (which differs from fp32's on these weights, so the
    services did run in bf16); a seeded sample is the in-process bf16 engine's (fresh
    services: a drafter's learned acceptance shapes its trees, see test_remote)."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    expected = plain_greedy(tiny_bf16, PROMPTS, MAX_TOKENS)
    assert expected != plain_greedy(tiny_loaded, PROMPTS, MAX_TOKENS)
    sampled = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, seed=11)
    drafter_args = (*LYANNA_FLAGS, "--dtype", "bfloat16")
    env = {"LYANNA_VERIFIER_DTYPE": "bf16"}
    with launch(tiny_model_dir, "lyanna", drafter_args=drafter_args, env=env) as deployment:
        with grpc.insecure_channel(deployment.verifier_addr) as channel:
            capacity = verifier_pb2_grpc.VerifierStub(channel).Capacity(
                verifier_pb2.CapacityRequest(), timeout=10
            )
        assert capacity.hidden_dtype == "bfloat16"
        drawn, _ = run_remote(config_for(deployment, pipeline=False), PROMPTS[:1], sampled)
        outcomes, _ = run_remote(config_for(deployment), PROMPTS, greedy)
    assert [o.tokens for o in outcomes] == expected
    steps = [s for o in outcomes for s in o.steps]
    assert sum(s.num_drafted for s in steps) > 0 and not any(s.drafter_fallback for s in steps)
    engine = engine_outputs(tiny_bf16, tiny_lyanna(tiny_bf16, BUDGET), PROMPTS[:1], sampled)
    assert [o.tokens for o in drawn] == engine


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="no GPU"))]
)
def test_bf16_smoke_on_device(tiny_model_dir, device) -> None:
    """The engine (plain and n-gram drafting, greedy and sampled) and a verifier servicer on
    the GPU in bf16, a few tokens each: the model, its KV cache and the step's tensors live on
    the device, and hidden rows come back as bf16 over the wire. (On the CPU too, so CI runs
    the test's own code; the CUDA case skips without a GPU.)"""
    model = load_model(tiny_model_dir, torch.bfloat16, device, weights="auto")
    assert model.embed_tokens.weight.device.type == device and model.dtype is torch.bfloat16
    plain = [Sequence(i, p, SamplingParams(max_tokens=8)) for i, p in enumerate(PROMPTS)]
    generate(model, plain)
    assert all(len(s.output_ids) == 8 for s in plain)
    engine = SpecEngine(model, NgramDrafter(DraftBudget(4, 2, 6)), EngineConfig(4, 128))
    assert engine.cache.keys.device.type == device
    for k, params in enumerate((SamplingParams(max_tokens=8), SamplingParams(0.9, seed=3))):
        seqs = [
            Sequence(10 * (k + 1) + i, p, replace(params, max_tokens=8))
            for i, p in enumerate(PROMPTS)
        ]
        for seq in seqs:
            engine.submit(seq)
        engine.run()
        assert all(len(s.output_ids) == 8 for s in seqs)
        assert all(0 <= t < model.config.vocab_size for s in seqs for t in s.output_ids)
    runner = TargetRunner(model, TargetConfig(max_running=2, max_len=128))
    servicer = VerifierServicer(runner, VerifierConfig(max_tree_nodes=8), HiddenSender())
    item = verifier_pb2.PrefillItem(seq_id=1, prompt_ids=PROMPTS[0], return_hidden=True)
    item.params.max_tokens = 8
    first = servicer.Prefill(verifier_pb2.PrefillRequest(items=[item]), FakeContext()).results[0]
    assert 0 <= first.first_token < model.config.vocab_size
    assert first.prompt_hidden.tensor.dtype == "bfloat16"
    tree = TokenTree.root_only(first.first_token)
    verify = verifier_pb2.VerifyItem(
        ref=common_pb2.SeqRef(seq_id=1, num_committed=len(PROMPTS[0])),
        tree=codec.encode_tree(tree),
        steps=3,
        return_hidden=True,
    )
    result = servicer.Verify(verifier_pb2.VerifyRequest(items=[verify]), FakeContext()).results[0]
    assert result.num_steps == 3 and len(result.committed) == 3
    assert result.hidden.tensor.dtype == "bfloat16"
    assert list(result.hidden.tensor.shape) == [3, model.config.hidden_size]


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="no GPU"))]
)
def test_services_on_device_carry_hidden_states_over_gloo(tiny_model_dir, device) -> None:
    """Verifier and drafter processes on ``device`` (the GPU case is the one that matters; the
    CPU case runs this test's code in CI), the hidden rows over the gloo data plane, which
    stages CUDA tensors through host memory: greedy output equals plain greedy decoding on
    that device, the rows did travel over the plane, and the drafter never fell back."""
    model = load_model(tiny_model_dir, torch.float32, device, weights="auto")
    expected = plain_greedy(model, PROMPTS, MAX_TOKENS)
    placement = ("--device", device, "--dtype", "float32", "--weights", "auto")
    with launch(
        tiny_model_dir,
        "lyanna",
        verifier_args=placement,
        drafter_args=(*LYANNA_FLAGS, "--device", device, "--dtype", "float32"),
        plane="gloo",
    ) as deployment:
        config = config_for(deployment, use_data_plane=True)
        outcomes, backend = run_remote(config, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.tokens for o in outcomes] == expected
    assert backend.drafter.num_plane_transfers > 0
    steps = [s for o in outcomes for s in o.steps]
    assert sum(s.num_drafted for s in steps) > 0 and not any(s.drafter_fallback for s in steps)
