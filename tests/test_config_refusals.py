"""The configuration refuses what cannot work: non-finite floats, integers beyond their use, sizes that would
exhaust memory, overflowing parameters, overlong paths, deep nesting, captures of nothing and partitions that
leave a client no data; all problems together, each naming its key and value."""

from __future__ import annotations

import math
import re
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.common import serde
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedguard.config import Config, ConfigError, flatten, load_config, schema
from fedguard.data.dataset import stratified_split
from fedguard.data.federated import partitions
from fedguard.data.partition import PartitionOptions, partition
from fedguard.data.registry import SourceOptions, load_dataset
from fedguard.data.sizes import CLASS_COUNTS, split_sizes, train_class_counts
from fedguard.limits import INT64_MAX, INT64_MIN, MAX_LISTED, MAX_NESTING, MAX_ROUNDS, shown
from fedguard.selection import Selection
from fedguard.spans import Spans

KEYS = schema()
FLOAT_KEYS = sorted(key for key, (kind, _, _) in KEYS.items() if kind is float)
INT_KEYS = sorted(key for key, (kind, _, _) in KEYS.items() if kind is int)
FOUR_CLIENTS = ["partition.num-clients=4", "train.clients-per-round=4"]


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    return caught.value.problems


# 1. non-finite floats


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_every_float_key_refuses_non_finite_values(value: str) -> None:
    assert len(FLOAT_KEYS) > 60  # core sections and every registered component's parameters
    for key in FLOAT_KEYS:
        problems = problems_of([f"{key}={value}"])
        assert any(p.startswith(f"{key} = ") and "finite" in p for p in problems), (key, problems)


def test_an_infinite_learning_rate_is_refused_by_key_and_value() -> None:
    [problem] = problems_of(["train.lr=inf"])
    assert problem == "train.lr = inf: must be a finite number"
    [problem] = problems_of(["defense.name=dp", "defense.dp.clip=nan"])
    assert problem == "defense.dp.clip = nan: must be a finite number"


def test_non_finite_and_overflowing_values_are_refused_from_flat_keys_too() -> None:
    with pytest.raises(ConfigError, match=r"sim.client-gpus = nan: must be a finite number"):
        Config.from_flat({"sim.client-gpus": float("nan")})
    with pytest.raises(ConfigError, match=r"train.lr = 1000.*0: must be a finite number"):
        Config.from_flat({"train.lr": 10**400})  # an integer beyond every float, from a TOML preset


# 2. integers beyond their use


def test_the_seed_is_refused_beyond_what_the_run_can_carry() -> None:
    [problem] = problems_of([f"seed={2**64}"])
    assert problem == (f"seed = {2**64}: must be >= 0 and <= {INT64_MAX} (flwr run carries integers in 64 bits)")
    [problem] = problems_of(["seed=-1"])
    assert problem == f"seed = -1: must be >= 0 and <= {INT64_MAX}"
    assert load_config(None, [f"seed={INT64_MAX}"]).run.seed == INT64_MAX


def test_the_largest_seed_is_usable_by_everything_the_run_seeds_with_it() -> None:
    """Flower's run config (sint64) is the narrowest: torch takes up to 2**64 - 1, numpy any size."""
    serde.user_config_to_proto({"seed": INT64_MAX})
    with pytest.raises(ValueError, match="out of range"):
        serde.user_config_to_proto({"seed": INT64_MAX + 1})
    torch.manual_seed(INT64_MAX)
    np.random.default_rng(np.random.SeedSequence([INT64_MAX, 3, 7]))


def test_every_int_key_refuses_integers_beyond_64_bits_naming_the_range() -> None:
    assert len(INT_KEYS) > 40
    for key in INT_KEYS:
        for value in (2**64, -(2**64)):
            problems = problems_of([f"{key}={value}"])
            assert any(p.startswith(f"{key} = {value}: must be >= ") and " and <= " in p for p in problems), (
                key,
                problems,
            )
    [problem] = problems_of([f"attack.dlg.iterations={2**64}"])
    assert problem == (
        f"attack.dlg.iterations = {2**64}: must be >= {INT64_MIN} and <= {INT64_MAX} "
        f"(flwr run carries integers in 64 bits)"
    )


@pytest.mark.parametrize(
    ("key", "limit"),
    [
        ("train.rounds", MAX_ROUNDS),
        ("partition.num-clients", 100_000),
        ("train.local-epochs", 10_000),
        ("data.image-size", 1024),
        ("pool.workers", 1024),
        ("pool.threads", 1024),
        ("pool.group", 1024),
    ],
)
def test_counts_have_upper_bounds(key: str, limit: int) -> None:
    problems = problems_of([f"{key}={limit + 1}"])
    assert any(p.startswith(f"{key} = {limit + 1}: must be >= ") and p.endswith(f"<= {limit}") for p in problems)


# 3. sizes counted, never expanded


def test_a_huge_capture_range_is_refused_without_expanding_it() -> None:
    tracemalloc.start()
    try:
        [rounds] = problems_of(["capture.rounds=1-1000000000"])
        [clients] = problems_of(["capture.clients=0-999999999999"])
        [listed] = problems_of(["train.rounds=20", "capture.rounds=" + ",".join(["1-20"] * (MAX_LISTED // 20 + 1))])
        [huge] = problems_of([f"train.rounds={10**12}"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20  # nothing expanded: a list of 10^12 rounds would not fit in memory at all
    assert rounds == (
        "capture.rounds = '1-1000000000': 21-1000000000 not in this run; this run's rounds are 1-20 (train.rounds = 20)"
    )
    assert clients.startswith("capture.clients = '0-999999999999': 10-999999999999 not in this run; client ids are 0-9")
    assert listed.startswith("capture.rounds = '1-20,1-20,") and f"; at most {MAX_LISTED}" in listed
    assert huge == f"train.rounds = {10**12}: must be >= 1 and <= {MAX_ROUNDS}"


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.lists(
        st.one_of(
            st.integers(0, 30).map(str),
            st.tuples(st.integers(0, 30), st.integers(0, 30)).map(lambda p: f"{min(p)}-{max(p)}"),
        ),
        min_size=1,
        max_size=6,
    ).map(",".join)
)
def test_spans_choose_exactly_what_the_run_expands(spec: str) -> None:
    spans, selection = Spans.parse(spec, "capture.rounds"), Selection.parse(spec, "capture.rounds")
    assert [n for n in range(-2, 40) if n in spans] == [n for n in range(-2, 40) if n in selection]
    assert spans.count(3, 17) == sum(1 for n in range(3, 18) if n in selection)
    assert [n for a, b in spans.outside(3, 17) for n in range(a, b + 1)] == [
        n for n in range(0, 40) if n in selection and not 3 <= n <= 17
    ]


@pytest.mark.parametrize("spec", ["a", "3-1", "1,,x", "-2", "1-2-3", "9" * 5000])
def test_spans_refuse_what_the_run_cannot_read(spec: str) -> None:
    with pytest.raises(ValueError, match="capture.rounds"):
        Selection.parse(spec, "capture.rounds")
    with pytest.raises(ValueError, match="capture.rounds"):
        Spans.parse(spec, "capture.rounds")


# 4. overflowing parameters, overlong paths, deep nesting


def test_a_huge_epsilon_gives_a_finite_noise_scale_instead_of_a_traceback() -> None:
    """epsilon = 1e23 once overflowed the calibration (the privacy profile, now computed in log space)."""
    for epsilon in (1e6, 1e23):
        params = load_config(None, ["defense.name=dp", f"defense.dp.epsilon={epsilon}"]).defense.params
        assert params.epsilon == epsilon and 0 < params.noise_scale < 1e-2


def test_overlong_and_impossible_paths_are_refused(tmp_path: Path) -> None:
    [problem] = problems_of([f"out-dir={tmp_path / ('a' * 300)}"])
    assert problem.startswith("out-dir = ") and "has 300 bytes" in problem and "PC_NAME_MAX" in problem
    [problem] = problems_of([f"out-dir={tmp_path}/" + "/".join(["b" * 200] * 25)])
    assert problem.startswith("out-dir = ") and "PC_PATH_MAX" in problem
    [problem] = problems_of(["name=" + "n" * 300])
    assert problem.startswith("name = 'nnn") and "PC_NAME_MAX" in problem
    [problem] = problems_of(["data.root=/data\x00"])
    assert problem == "data.root = '/data\\x00': a path cannot hold a NUL character"
    problems = problems_of(["attack.name=ggl", "attack.ggl.generator=" + "g" * 300 + ".npz"])
    assert any(p.startswith("attack.ggl.generator = 'ggg") and "PC_NAME_MAX" in p for p in problems), problems
    assert load_config(None, [f"out-dir={tmp_path / ('a' * 200)}"]).run.out_dir.endswith("a" * 200)


@pytest.mark.parametrize(
    "text",
    [
        "[" + ".".join(["a"] * 1000) + "]\nx = 1\n",
        ".".join(["a"] * 1000) + " = 1\n",
        "a = " + "{a = " * 1000 + "1" + "}" * 1000 + "\n",
        "a = " + "[" * 1000 + "1" + "]" * 1000 + "\n",
    ],
)
def test_deeply_nested_presets_are_refused(tmp_path: Path, text: str) -> None:
    preset = tmp_path / "deep.toml"
    preset.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(preset)
    [problem] = caught.value.problems
    assert problem.startswith(f"preset {shown(str(preset))}: ")  # a long path is elided in the middle
    assert f"more than {MAX_NESTING} deep" in problem or "nested too deeply to read" in problem


def test_nested_values_and_unreadable_presets_are_refused(tmp_path: Path) -> None:
    deep: Any = 1
    for _ in range(5000):
        deep = {"a": deep}
    assert flatten(deep) == {".".join(["a"] * 5000): 1}
    with pytest.raises(ConfigError, match=r"^invalid configuration:\n  train.rounds = \{'a': \{'a': \{'a': \{\.\.\.\}"):
        Config.from_flat({"train.rounds": deep})
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot be read as text"):
        load_config(binary)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / ("x" * 5000))


# 5. captures of nothing


def test_capturing_a_client_that_does_not_exist_is_refused() -> None:
    [problem] = problems_of([*FOUR_CLIENTS, "capture.clients=99"])
    assert problem == ("capture.clients = '99': 99 not in this run; client ids are 0-3 (partition.num-clients = 4)")
    [problem] = problems_of([*FOUR_CLIENTS, "capture.clients=none"])
    assert problem.startswith("capture.clients = 'none' selects no client") and "0-3" in problem
    assert load_config(None, [*FOUR_CLIENTS, "capture.clients=none", "capture.rounds=none"]).capture.clients == "none"
    assert load_config(None, [*FOUR_CLIENTS, "capture.clients=1-3"]).capture.clients == "1-3"


def test_capturing_rounds_beyond_the_run_is_refused() -> None:
    [problem] = problems_of(["train.rounds=3", "capture.rounds=0,2-5"])
    assert problem == "capture.rounds = '0,2-5': 0, 4-5 not in this run; this run's rounds are 1-3 (train.rounds = 3)"
    assert load_config(None, ["train.rounds=3", "capture.rounds=1-3"]).capture.rounds == "1-3"


def test_a_bad_train_rounds_is_not_blamed_on_the_capture() -> None:
    [problem] = problems_of(["train.rounds=0", "capture.rounds=1-5"])
    assert problem.startswith("train.rounds = 0: ")


# 6. partitions that leave a client no data


def test_a_test_fraction_that_leaves_clients_no_training_data_is_refused() -> None:
    [problem] = problems_of(["data.test-fraction=0.9999"])
    assert problem.startswith(
        "data.name = 'mnist-5k', data.test-fraction = 0.9999 leaves 0 training samples for partition.num-clients = 10"
    )
    assert problem.endswith("choose a smaller data.test-fraction")
    [problem] = problems_of(
        ["data.name=digits", "data.test-fraction=0.99", "partition.num-clients=21", "train.clients-per-round=5"]
    )
    assert "leaves 20 training samples" in problem and "at most 20 clients or a smaller data.test-fraction" in problem
    [problem] = problems_of(["data.test-fraction=0.0001"])
    assert problem.startswith("data.name = 'mnist-5k', data.test-fraction = 0.0001: leaves the test split empty")


def test_the_largest_accepted_partition_gives_every_client_data() -> None:
    """The arithmetic limit is the real one: at 20 training samples, 20 clients each hold one, and 21 are refused."""
    config = load_config(
        None, ["data.name=digits", "data.test-fraction=0.99", "partition.num-clients=20", "train.clients-per-round=5"]
    )
    parts = partitions("digits", config.data.source_options(), "iid", PartitionOptions(), 20, 0)
    assert sorted(len(p) for p in parts) == [1] * 20


def test_the_dirichlet_partition_needs_two_samples_per_client() -> None:
    base = ["data.name=lfw-faces", "partition.name=dirichlet", "train.clients-per-round=2"]
    [problem] = problems_of([*base, "partition.num-clients=81"])
    assert "leaves 160 training samples" in problem and "'dirichlet' needs 2 per client" in problem
    # at the default alpha = 0.5 no draw gives each of 80 clients a sample (refused too); a flat one does
    assert load_config(None, [*base, "partition.num-clients=80", "partition.alpha=100"]).partition.num_clients == 80
    [problem] = problems_of([*base, "partition.num-clients=80"])
    assert "partition.alpha = 0.5 over 80 clients left a client with fewer than 1 samples" in problem


def test_photos_larger_than_their_tiles_and_too_many_classes_are_refused() -> None:
    [problem] = problems_of(["data.name=photos", "data.image-size=300"])
    assert problem == (
        "data.name = 'photos', data.test-fraction = 0.2, data.image-size = 300: the data set holds "
        "no samples at these settings"
    )
    [problem] = problems_of(["partition.name=classes", "partition.classes-per-client=11"])
    assert problem == "partition.classes-per-client = 11: data.name = 'mnist-5k' has 10 classes; choose 1 to 10"


@pytest.mark.parametrize("name", sorted(CLASS_COUNTS))
def test_sizes_known_without_loading_match_the_loaded_data(name: str) -> None:
    data = load_dataset(name, SourceOptions())
    labels = np.concatenate([data.train.labels.numpy(), data.test.labels.numpy()])
    assert tuple(np.bincount(labels).tolist()) == CLASS_COUNTS[name]
    for fraction in (0.001, 0.2, 0.5, 0.995):
        train, test = stratified_split(labels, fraction)
        sizes = split_sizes(name, SourceOptions(test_fraction=fraction))
        assert (sizes.train, sizes.test) == (len(train), len(test))


@pytest.mark.parametrize("size", [32, 100, 256])
def test_photo_sizes_known_without_loading_match_the_loaded_tiles(size: int) -> None:
    data = load_dataset("photos", SourceOptions(image_size=size))
    sizes = split_sizes("photos", SourceOptions(image_size=size))
    assert (sizes.train, sizes.test) == (len(data.train), len(data.test))


# 7. every problem at once


def test_every_problem_is_reported_together_naming_key_and_value(tmp_path: Path) -> None:
    problems = problems_of(
        [
            "train.rounds=x",
            "bogus=1",
            "train.lr=nan",
            f"seed={2**64}",
            *FOUR_CLIENTS,
            "capture.clients=7",
            "data.test-fraction=0.9999",
            "defense.name=dp",
            "defense.dp.epsilon=-1",
            "server.plugin-params='",
        ]
    )
    assert len(problems) == 8, problems
    for fragment in (
        "train.rounds = 'x'",
        "'bogus'",
        "train.lr = nan",
        f"seed = {2**64}",
        "capture.clients = '7'",
        "data.test-fraction = 0.9999",
        "defense.dp.epsilon = -1.0",
        'server.plugin-params = "\'"',
    ):
        assert sum(fragment in p for p in problems) == 1, (fragment, problems)
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(ConfigError) as caught:
        load_config(broken, ["train.rounds=x"])
    assert len(caught.value.problems) == 2 and "not valid TOML" in caught.value.problems[0]


# 8. every key, any value: a configuration or a ConfigError naming the key


def _text_of(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


VALUES = st.recursive(
    st.one_of(
        st.integers(),
        st.integers(min_value=2**62, max_value=2**80),
        st.integers(max_value=-(2**62)),
        st.floats(),
        st.sampled_from([math.nan, math.inf, -math.inf, 1e308, 5e-324]),
        st.booleans(),
        st.text(max_size=30),
        st.text(max_size=3000),
        st.just(""),
        st.sampled_from(["1-1000000000", "all"]),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)


@settings(max_examples=1500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(KEYS)), value=VALUES)
def test_any_value_of_any_key_gives_a_configuration_or_a_config_error_naming_the_key(key: str, value: Any) -> None:
    for attempt in (lambda: load_config(None, [f"{key}={_text_of(value)}"]), lambda: Config.from_flat({key: value})):
        try:
            attempt()
        except ConfigError as error:
            assert key in str(error), (key, value, error.problems)


@pytest.mark.parametrize("name", ["..", ".", "/abs/run", "a/b", "line\nbreak", "", "run name", "../up"])
def test_a_run_name_is_one_folder_name(name: str) -> None:
    problems = problems_of([f"name={name}"])
    assert len(problems) == 1 and problems[0].startswith("name = ") and "one folder name" in problems[0], problems
    assert "--out" in problems[0]


def test_fedguard_run_refuses_a_name_that_leaves_the_runs_folder_before_writing_anything(tmp_path: Path) -> None:
    import subprocess
    import sys

    for name in ("..", ".", str(tmp_path / "abs"), "a\nb"):
        result = subprocess.run(
            [sys.executable, "-m", "fedguard", "run", "--set", f"name={name}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2 and "name = " in result.stderr and "one folder name" in result.stderr
    assert list(tmp_path.iterdir()) == [], "nothing is written"


# 9. configurations that cannot run, refused before anything starts (issue 33, item 6)

BN = "model.mlp.batch-norm=true"
FEW_CLIENTS = ["partition.num-clients=50", "train.clients-per-round=2"]
CANNOT_RUN = [
    # a BatchNorm model on batches of one sample (its training step raises)
    ([BN, "train.batch-size=1"], "train.batch-size"),
    ([BN, "partition.max-per-client=1"], "partition.max-per-client"),
    ([BN, "train.protocol=fedavg", "partition.max-per-client=9", "train.batch-size=8"], "train.batch-size"),
    ([BN, "partition.name=classes", "train.protocol=fedavg", "train.batch-size=7"], "train.batch-size"),
    (["data.name=digits", "model.name=resnet18", "train.batch-size=1"], "train.batch-size"),
    # a model that cannot take the data set's images
    (["data.name=digits", "model.name=convnet"], "model.name"),
    (["data.name=photos", "data.image-size=8", "model.name=convnet"], "model.name"),
    # a Dirichlet partition no draw of which gives every client its minimum
    (["partition.name=dirichlet", "partition.alpha=0.001", *FEW_CLIENTS], "partition.alpha"),
    (
        ["data.name=lfw-faces", "partition.name=dirichlet", "partition.alpha=0.3", "partition.num-clients=20"],
        "partition.alpha",
    ),
    # a manipulation that cannot rewrite the model
    (["threat.malicious=1:imprint", "model.name=convnet"], "threat.malicious"),
    (["threat.malicious=1:trap-weights", "model.name=lenet"], "threat.malicious"),
    (["attack.name=imprint", "threat.malicious=1:imprint", "model.mlp.hidden=32"], "manipulation.imprint.bins"),
    (["threat.malicious=1:imprint", "model.mlp.depth=0"], "manipulation.imprint.bins"),
    # a search across rounds whose clients would not upload one unchanging batch, or not a gradient
    (["threat.malicious=1-4:feature-fishing", "model.name=lenet", "data.name=digits"], "partition.max-per-client"),
    (
        ["threat.malicious=1-4:feature-fishing", "partition.max-per-client=8", "train.protocol=fedavg"],
        "train.protocol",
    ),
    (
        ["attack.name=feature-fishing", "threat.malicious=1:feature-fishing", BN, "partition.max-per-client=8"],
        "attack.name",
    ),
    # an attack that cannot attack the model
    (["attack.name=gradinversion", "threat.bn-statistics=true"], "attack.name"),
    (
        ["attack.name=gradinversion", "threat.bn-statistics=true", "attack.gradinversion.bn=0", "model.name=lenet"],
        "attack.name",
    ),
    (["attack.name=ig", "attack.ig.skip=1.,3.,5."], "attack.ig.skip"),
    # DP-SGD's data set size below the batches the clients draw
    (["defense.name=dp-sgd", "defense.dp-sgd.dataset-size=4", "train.batch-size=8"], "defense.dp-sgd.dataset-size"),
    # Bulyan with fewer clients per round than it aggregates from: no round would change the model
    (
        ["server.strategy=bulyan", "server.bulyan.num-malicious-nodes=1", "train.clients-per-round=4"],
        "train.clients-per-round",
    ),
    (["server.strategy=bulyan", "train.clients-per-round=2"], "server.bulyan.num-malicious-nodes"),
    # MLflow without an experiment name (it would run untracked)
    (["track.mlflow=true", "track.mlflow-experiment="], "track.mlflow-experiment"),
    # places no machine has: a data set that loads from data.root only, without one; not an address
    (["data.name=mnist"], "data.root"),
    (["data.name=imagefolder"], "data.root"),
    (["sim.address=notanaddress"], "sim.address"),
    # a defense that cannot defend the model
    (["defense.name=soteria", "defense.soteria.layer=fc"], "defense.soteria"),
]


@pytest.mark.parametrize(("overrides", "key"), CANNOT_RUN, ids=[" ".join(o) for o, _ in CANNOT_RUN])
def test_a_configuration_that_cannot_run_is_refused_naming_the_key(
    overrides: list[str], key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of these passed the check once and then failed in the run (a client, the server, an attack or the
    strategy raised, or the run went on doing nothing); the check now refuses it, naming the key."""
    monkeypatch.chdir(tmp_path)
    problems = problems_of(overrides)
    assert any(key in problem for problem in problems), problems
    assert list(tmp_path.iterdir()) == [], "nothing is written"


@pytest.mark.parametrize(
    "overrides",
    [
        [BN, "train.batch-size=2"],
        [BN, "train.protocol=fedavg", "partition.max-per-client=10", "train.batch-size=8"],
        ["data.name=digits", "model.name=lenet"],
        ["data.name=photos", "data.image-size=9", "model.name=convnet"],
        ["partition.name=dirichlet", "partition.alpha=0.5", *FEW_CLIENTS],
        ["attack.name=imprint", "threat.malicious=1:imprint", "model.mlp.hidden=64"],
        [
            "attack.name=feature-fishing",
            "threat.malicious=1-4:feature-fishing",
            "capture.rounds=1-4",
            "partition.max-per-client=32",
        ],
        ["attack.name=gradinversion", "threat.bn-statistics=true", BN],
        ["attack.name=ig", "attack.ig.skip=5."],
        ["defense.name=dp-sgd", "defense.dp-sgd.dataset-size=32"],
        ["server.strategy=bulyan", "train.clients-per-round=3"],
        ["data.name=mnist", "data.root=/absent"],
        ["sim.address=127.0.0.1:6379"],
        ["defense.name=soteria", "defense.soteria.layer=3"],
    ],
)
def test_their_neighbours_that_can_run_are_accepted(overrides: list[str]) -> None:
    load_config(None, overrides)


@pytest.mark.parametrize("name", sorted(CLASS_COUNTS))
def test_training_class_counts_known_without_loading_match_the_loaded_data(name: str) -> None:
    """The check partitions labels of these counts: the clients' shares are those of the loaded data."""
    data = load_dataset(name, SourceOptions())
    assert train_class_counts(name, SourceOptions()) == tuple(np.bincount(data.train.labels.numpy()).tolist())
    options = PartitionOptions(alpha=0.3)
    synthetic = np.repeat(np.arange(len(CLASS_COUNTS[name])), train_class_counts(name, SourceOptions()) or ())
    real = partitions(name, SourceOptions(), "dirichlet", options, 4, 0)
    assert [len(p) for p in partition(synthetic, 4, "dirichlet", options, 0)] == [len(p) for p in real]


# 10. what this machine lacks, refused by `fedguard run` before it loads or writes anything


def test_an_attack_on_cuda_is_refused_where_a_local_run_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedguard.runtime.simulation import resource_problems

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = load_config(None, ["attack.name=ig, dlg", "attack.ig.device=cuda", "attack.dlg.device=cuda"])
    assert resource_problems(config) == [
        f"attack.{name}.device = {device!r}: CUDA is not available on this machine, where a local simulation's "
        f"attack workers run; set it to auto (CUDA when present) or cpu"
        for name, device in (("ig", "cuda"), ("dlg", "cuda"))
    ]
    assert resource_problems(load_config(None, ["attack.name=ig", "attack.ig.device=auto"])) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fedguard_run_refuses_what_this_machine_lacks_before_writing_anything(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        silent = f"http://127.0.0.1:{probe.getsockname()[1]}"
    overrides = {
        "attack.ig.device": "cuda",
        "sim.client-gpus": "1",
        "sim.client-cpus": "4096",
        "track.mlflow-uri": silent,
    }
    command = [sys.executable, "-m", "fedguard", "run", "--set", "attack.name=ig", "--set", "track.mlflow=true"]
    result = subprocess.run(
        [*command, *(f"--set={key}={value}" for key, value in overrides.items())],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    for key in overrides:
        assert f"  {key} = " in result.stderr, (key, result.stderr)
    assert list(tmp_path.iterdir()) == [], "nothing is written"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fedguard_sweep_refuses_what_this_machine_lacks_before_any_run(tmp_path: Path) -> None:
    import subprocess
    import sys

    preset = tmp_path / "two.toml"
    preset.write_text(
        '[attack]\nname = "ig"\n\n[sweep.variants]\nnone = {}\nprune = { "defense.name" = "prune" }\n'
        'cuda = { "attack.ig.device" = "cuda" }\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "fedguard", "sweep", str(preset), "--set", "sim.client-cpus=4096"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = [line.strip() for line in result.stderr.splitlines() if line.startswith("  ")]
    assert len(lines) == 2, result.stderr  # each problem once, with the first run it concerns
    assert lines[0].startswith("run/none: sim.client-cpus = 4096: ")
    assert lines[1].startswith("run/cuda: attack.ig.device = 'cuda': CUDA is not available")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.toml"], "nothing is written"


def test_an_out_folder_under_a_file_or_not_writable_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    from fedguard.commands.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    assert main(["run", "--out", "a-file/run"]) == 2
    err = capsys.readouterr().err
    assert f"--out = 'a-file/run': {tmp_path / 'a-file'} is a file, not a folder" in err and "Traceback" not in err
    preset = str(Path(__file__).resolve().parents[1] / "experiments" / "defenses.toml")
    assert main(["sweep", preset, "--only", "realistic/none", "--out", "a-file/sweep"]) == 2
    err = capsys.readouterr().err
    assert f"--out = 'a-file/sweep': {tmp_path / 'a-file'} is a file, not a folder" in err and "Traceback" not in err

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("fedguard.limits.tempfile.TemporaryFile", read_only)
    assert main(["run", "--out", "mounted/run"]) == 2
    err = capsys.readouterr().err
    assert f"--out = 'mounted/run': cannot write in {tmp_path} (Read-only file system)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"], "nothing is written"


def test_a_learning_rate_that_overflows_the_first_step_is_refused_by_key() -> None:
    [problem] = problems_of(["train.lr=1e308"])
    assert problem == "train.lr = 1e+308: must be > 0.0 and < 1000000.0"
    load_config(None, ["train.lr=1e5"])


def test_a_plugin_that_raises_or_exits_on_import_is_named_and_the_run_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedguard.commands.cli import main

    (tmp_path / "raising_plugin.py").write_text("raise RuntimeError('no licence file')\n")
    (tmp_path / "exiting_plugin.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    [raised] = problems_of(["server.plugins=raising_plugin"])
    assert raised == (
        "server.plugins = 'raising_plugin': cannot import 'raising_plugin' (RuntimeError: no licence file)"
    )
    [exited] = problems_of(["server.plugins=exiting_plugin"])
    assert exited.startswith("server.plugins = 'exiting_plugin': importing 'exiting_plugin' called sys.exit(0)")
    assert main(["run", "--set", "server.plugins=exiting_plugin"]) == 2
    assert "called sys.exit(0)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists(), "nothing is written"


def test_the_checked_share_sizes_are_the_partitioners_and_computed_once_per_split() -> None:
    """A sweep's runs differ mostly in what does not move the split: each distinct split is drawn once."""
    from fedguard.config_checks import share_sizes

    counts, options = (120, 80, 200, 40), PartitionOptions(alpha=0.3)
    labels = np.repeat(np.arange(4), counts)
    share_sizes.cache_clear()
    sizes = share_sizes(counts, 6, "dirichlet", options, 7)
    assert list(sizes) == [len(p) for p in partition(labels, 6, "dirichlet", options, 7)] and sum(sizes) == 440
    for variant in ("none", "dp", "dgp"):  # the runs of three variants that share the data, the split and the seed
        load_config(None, ["partition.name=dirichlet", f"defense.name={variant}", "seed=3"])
    info = share_sizes.cache_info()
    assert (info.misses, info.hits) == (2, 2), info
    assert share_sizes(counts, 6, "dirichlet", options, 8) != sizes  # another seed, another split


# 5. numeric extremes of every step size and noise scale: refused naming key, value and range, or run as given

DP, DP_SGD, CENSOR = ["defense.name=dp"], ["defense.name=dp-sgd"], ["defense.name=censor"]
FEDAVGM, FEDADAM = ["server.strategy=fedavgm"], ["server.strategy=fedadam"]
FEDPROX = ["server.strategy=fedprox", "train.protocol=fedavg"]
STEP = r"must be > 0 and < 1e\+06"
NOISE = r"must be < 1e\+30 \(fedguard.limits.MAX_NOISE_STD"
SGM = r"noise-multiplier must be 0 \(no noise\) or in \[0.001, 1e\+06\] \(fedguard.limits.SGM_NOISE_RANGE"
EXTREMES = [
    # (the chosen component, key, value, what the refusal says; None: accepted, the run trains as configured)
    ([], "train.lr", "1e308", r"train.lr = 1e\+308: must be > 0.0 and < 1000000.0"),
    ([], "train.lr", "1e-308", None),
    ([], "train.lr", "0", r"train.lr = 0.0: must be > 0.0 and < 1000000.0"),
    ([], "train.lr", "-1", r"train.lr = -1.0: must be > 0.0"),
    (FEDAVGM, "server.fedavgm.server-learning-rate", "1e308", rf"server-learning-rate = 1e\+308: {STEP}"),
    (FEDAVGM, "server.fedavgm.server-learning-rate", "0", rf"server-learning-rate = 0.0: {STEP}"),
    (FEDAVGM, "server.fedavgm.server-momentum", "1e308", r"server-momentum = 1e\+308: must be in \[0.0, 1.0\)"),
    (FEDAVGM, "server.fedavgm.server-momentum", "1", r"server-momentum = 1.0: must be in \[0.0, 1.0\)"),
    (FEDAVGM, "server.fedavgm.server-momentum", "-1", r"server-momentum = -1.0: must be in \[0.0, 1.0\)"),
    (FEDAVGM, "server.fedavgm.server-momentum", "1e-308", None),
    (FEDADAM, "server.fedadam.eta", "1e308", rf"eta = 1e\+308: {STEP}"),
    (FEDADAM, "server.fedadam.eta", "-1", rf"eta = -1.0: {STEP}"),
    (FEDADAM, "server.fedadam.tau", "0", r"tau = 0.0: must be > 0"),
    (FEDADAM, "server.fedadam.tau", "1e-308", None),  # runs, and stops at its first step: the run-time case
    (FEDADAM, "server.fedadam.beta-1", "1e308", r"beta-1 = 1e\+308: must be in \[0.0, 1.0\)"),
    (FEDPROX, "server.fedprox.proximal-mu", "1e308", r"proximal-mu = 1e\+308 with train.lr = 0.5: .* must be < 2"),
    (FEDPROX, "server.fedprox.proximal-mu", "3.9", None),
    (FEDPROX, "server.fedprox.proximal-mu", "4", r"proximal-mu = 4.0 with train.lr = 0.5: .* must be < 2"),
    (DP, "defense.dp.clip", "1e308", rf"noise scale .* is 1e\+307: {NOISE}"),
    (DP, "defense.dp.clip", "1e-308", None),
    (DP, "defense.dp.clip", "0", r"clip must be > 0, got 0.0 \(defense.dp.clip = 0.0\)"),
    (DP, "defense.dp.noise-multiplier", "1e308", rf"noise scale .* is 1e\+308: {NOISE}"),
    (DP, "defense.dp.noise-multiplier", "-1", r"noise-multiplier must be >= 0, got -1.0"),
    ([*DP, "defense.dp.mechanism=laplace"], "defense.dp.noise-multiplier", "1e308", rf"is 1e\+308: {NOISE}"),
    ([*DP, "defense.dp.clip=1e308"], "defense.dp.noise-multiplier", "0", None),  # no noise: the clip is no bound
    (DP, "defense.dp.epsilon", "1e308", None),
    (DP, "defense.dp.epsilon", "1e-308", None),  # the calibration's largest noise, 8e4: finite
    (DP, "defense.dp.epsilon", "-1", r"epsilon must be finite and >= 0"),
    (DP, "defense.dp.delta", "1e308", r"delta must be in \(0, 1\), got 1e\+308"),
    (DP_SGD, "defense.dp-sgd.clip", "1e308", rf"clip \* noise-multiplier = 1e\+308: {NOISE}"),
    (DP_SGD, "defense.dp-sgd.clip", "0", r"clip must be finite and > 0, got 0.0"),
    (DP_SGD, "defense.dp-sgd.noise-multiplier", "1e308", rf"{SGM}.*got 1e\+308"),
    (DP_SGD, "defense.dp-sgd.noise-multiplier", "1e-308", rf"{SGM}.*got 1e-308"),
    (DP_SGD, "defense.dp-sgd.noise-multiplier", "-1", rf"{SGM}.*got -1.0"),
    (DP_SGD, "defense.dp-sgd.noise-multiplier", "0", None),
    (CENSOR, "defense.censor.probe-lr", "1e308", r"probe-lr must be > 0 and < 1e\+06 \(fedguard.limits.MAX_LR\)"),
    (CENSOR, "defense.censor.probe-lr", "0", r"probe-lr must be > 0 and < 1e\+06"),
    (CENSOR, "defense.censor.temperature", "1e-308", None),
    (CENSOR, "defense.censor.temperature", "1e308", None),
]


@pytest.mark.parametrize(("chosen", "key", "value", "refusal"), EXTREMES, ids=[f"{k}={v}" for _, k, v, _ in EXTREMES])
def test_an_extreme_step_or_noise_is_refused_naming_key_value_and_range(
    chosen: list[str], key: str, value: str, refusal: str | None
) -> None:
    """Each refused value raised in the run once (an overflowing accountant or probe step, a NaN draw) or made
    every upload non-finite (the run trained on nothing); non-finite values are refused for every key above."""
    overrides = [*chosen, f"{key}={value}"]
    if refusal is None:
        load_config(None, overrides)
        return
    problems = problems_of(overrides)
    assert any(key.rsplit(".", 1)[0] in p and re.search(refusal, p) for p in problems), problems
