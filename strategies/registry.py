"""Server strategies by name: fedguard's FedSGD and Flower's built-in strategies.

``server.strategy`` picks one and ``server.<name>.<parameter>`` sets its parameters; ``auto`` is the run's
protocol's own (``fedguard.protocols``). Each entry says what it aggregates: models (Flower's strategies,
which take gradient uploads through ``strategies.GradientStep``: each gradient becomes the model one SGD step
reaches) or gradients alone (fedguard's FedSGD), and whether it needs the clients to train locally
(FedProx, whose proximal term has a zero gradient at the global model where a one-batch client computes its
gradient, so that it would silently be FedAvg).

A strategy of your own, in a module of yours::

    from strategies.registry import StrategyContext, register_strategy

    @register_strategy("my-strategy", params=MyParams)
    def build(context: StrategyContext, params: MyParams) -> Strategy:
        return MyStrategy(**context.sampling(), ...)

and ``server.plugins = "my_module"`` (imported before the configuration is checked),
``server.strategy = "my-strategy"``. ``extensions/`` holds a tested one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flwr.serverapp import strategy as flower
from flwr.serverapp.strategy import Strategy

from fedguard.limits import MAX_LR
from fedguard.protocols import PROTOCOLS, Protocol, protocol
from fedguard.registry import NoParams, Registry
from strategies.fedsgd import FedSGD

AUTO = "auto"
MODELS, GRADIENTS = "models", "gradients"


@dataclass(frozen=True)
class StrategyContext:
    """What every strategy is built from: the run's sampling and, for FedSGD, the step and the model's layout.

    ``clients_per_round`` nodes are sampled in each round out of ``num_clients``."""

    clients_per_round: int
    num_clients: int
    lr: float
    trainable: tuple[bool, ...]

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments of Flower's strategies that sample ``clients_per_round`` nodes per round."""
        return {
            "fraction_train": self.clients_per_round / self.num_clients,
            "min_train_nodes": self.clients_per_round,
            "min_available_nodes": self.clients_per_round,
        }


StrategyBuilder = Callable[[StrategyContext, Any], Strategy]
STRATEGIES: Registry[StrategyBuilder] = Registry("strategy")


@dataclass(frozen=True)
class Aggregation:
    """What a strategy aggregates: ``models`` (gradient uploads reach it through ``GradientStep``) or
    ``gradients`` alone; ``local_training``: it only works when the clients train locally, and why;
    ``min_replies``: the fewest replies a round needs to change the model, given the strategy's parameters
    (None: one)."""

    aggregates: str = MODELS
    local_training: str = ""
    min_replies: Callable[[Any], int] | None = None

    def takes(self, run: Protocol) -> bool:
        """Whether the uploads of the protocol ``run`` suit this aggregation."""
        if self.aggregates == GRADIENTS and run.upload_kind != "gradient":
            return False
        return not (self.local_training and run.one_batch)


_AGGREGATION: dict[str, Aggregation] = {}


def register_strategy(
    name: str,
    params: type = NoParams,
    aggregates: str = MODELS,
    local_training: str = "",
    min_replies: Callable[[Any], int] | None = None,
) -> Callable[[StrategyBuilder], StrategyBuilder]:
    """Register a strategy builder ``(context, params) -> Strategy`` under ``name``. ``aggregates``: 'models'
    (weight uploads as they come, gradient uploads through ``GradientStep``) or 'gradients' (gradient uploads
    only); ``local_training``: non-empty when it needs clients that train locally, saying why; ``min_replies``:
    ``params -> int``, the fewest replies a round needs to change the model (a run with fewer clients per round
    is refused)."""
    if aggregates not in (MODELS, GRADIENTS):
        raise ValueError(f"strategy {name!r}: aggregates = {aggregates!r}; choose {MODELS!r} or {GRADIENTS!r}")
    register = STRATEGIES.register(name, params)

    def decorator(builder: StrategyBuilder) -> StrategyBuilder:
        register(builder)
        _AGGREGATION[name] = Aggregation(aggregates, local_training, min_replies)
        return builder

    return decorator


def aggregates_gradients(name: str) -> bool:
    """Whether the registered strategy ``name`` takes gradient uploads itself (no ``GradientStep`` in front)."""
    return _AGGREGATION[name].aggregates == GRADIENTS


def min_replies(name: str, params: Any) -> int:
    """The fewest replies a round of the registered strategy ``name`` with ``params`` needs to change the
    model (1 unless it declares more)."""
    needed = _AGGREGATION[name].min_replies
    return 1 if needed is None else needed(params)


def strategy_names() -> list[str]:
    """The valid values of ``server.strategy``."""
    return [AUTO, *STRATEGIES.names()]


def resolve(name: str, protocol_name: str) -> str:
    """The strategy ``name`` stands for under the protocol ``protocol_name`` ('auto': the protocol's own)."""
    return protocol(protocol_name).default_strategy if name == AUTO else name


def protocol_problem(name: str, protocol_name: str) -> str | None:
    """Why strategy ``name`` cannot aggregate the uploads of the protocol ``protocol_name``, or None."""
    resolved = resolve(name, protocol_name)
    if resolved not in _AGGREGATION:
        return None
    aggregation = _AGGREGATION[resolved]
    compatible = [p for p in PROTOCOLS.names() if aggregation.takes(protocol(p))]
    if protocol_name in compatible:
        return None
    why = aggregation.local_training if protocol(protocol_name).one_batch else ""
    takes = " and ".join(compatible) or "no registered protocol's"
    return f"server.strategy = {name!r} aggregates {takes} uploads only, but train.protocol = {protocol_name!r}" + (
        f": {why}" if why else ""
    )


@register_strategy("fedsgd", aggregates=GRADIENTS)
def _fedsgd(context: StrategyContext, _: NoParams) -> Strategy:
    """fedguard's FedSGD: uniform mean of the gradients, one server SGD step of train.lr"""
    return FedSGD(lr=context.lr, trainable=context.trainable, **context.sampling())


@register_strategy("fedavg")
def _fedavg(context: StrategyContext, _: NoParams) -> Strategy:
    """Flower's FedAvg: mean of the models weighted by examples"""
    return flower.FedAvg(**context.sampling())


@register_strategy("fedmedian")
def _fedmedian(context: StrategyContext, _: NoParams) -> Strategy:
    """Flower's FedMedian: coordinate-wise median of the models"""
    return flower.FedMedian(**context.sampling())


def _flower_params(name: str, fields: dict[str, tuple[type, Any, str]], doc: str) -> type:
    """A frozen parameter dataclass for one of Flower's strategies (field name -> (type, default, help))."""

    def check(self: Any) -> None:
        for field_name in fields:
            value = getattr(self, field_name)
            low, high = _BOUNDS.get(field_name, (0.0, float("inf")))
            if not low <= value < high or (field_name in _POSITIVE and value == 0):
                positive = field_name in _POSITIVE
                if high == float("inf"):
                    bound = "> 0" if positive else ">= 0"
                else:
                    bound = f"> 0 and < {high:g}" if positive else f"in [{low}, {high})"
                raise ValueError(f"{field_name.replace('_', '-')} = {value!r}: must be {bound}")

    params = dataclasses.make_dataclass(
        name,
        [(f, t, dataclasses.field(default=d, metadata={"help": h})) for f, (t, d, h) in fields.items()],
        frozen=True,
        namespace={"__post_init__": check},
    )
    params.__doc__ = doc
    return params


_BOUNDS = {
    "beta": (0.0, 0.5),
    "beta_1": (0.0, 1.0),
    "beta_2": (0.0, 1.0),
    "server_momentum": (0.0, 1.0),  # at 1 or more the velocity grows every round
    "eta": (0.0, MAX_LR),  # step sizes: fedguard.limits
    "server_learning_rate": (0.0, MAX_LR),
}
_POSITIVE = frozenset({"eta", "server_learning_rate", "tau", "num_nodes_to_select"})


_OPT = {
    "eta": (float, 0.1, "server-side learning rate"),
    "beta_1": (float, 0.9, "momentum parameter"),
    "beta_2": (float, 0.99, "second-moment parameter"),
    "tau": (float, 1e-3, "degree of adaptability"),
}
FLOWER_STRATEGIES: dict[str, tuple[type, dict[str, tuple[type, Any, str]], str]] = {
    "fedadagrad": (
        flower.FedAdagrad,
        {k: _OPT[k] for k in ("eta", "tau")},
        "Flower's FedAdagrad: adaptive server step on the mean model change",
    ),
    "fedadam": (flower.FedAdam, dict(_OPT), "Flower's FedAdam: Adam server step on the mean model change"),
    "fedyogi": (
        flower.FedYogi,
        {**_OPT, "eta": (float, 0.01, "server-side learning rate")},
        "Flower's FedYogi: Yogi server step on the mean model change",
    ),
    "fedavgm": (
        flower.FedAvgM,
        {
            "server_learning_rate": (float, 1.0, "server-side learning rate"),
            "server_momentum": (float, 0.0, "server-side momentum"),
        },
        "Flower's FedAvgM: FedAvg with server momentum",
    ),
    "fedprox": (
        flower.FedProx,
        {"proximal_mu": (float, 0.01, "weight mu of the clients' proximal term mu/2 ||w - w_global||^2")},
        "Flower's FedProx: FedAvg whose clients add a proximal term",
    ),
    "krum": (
        flower.Krum,
        {"num_malicious_nodes": (int, 0, "Byzantine nodes tolerated")},
        "Flower's Krum: the model closest to its neighbours",
    ),
    "multikrum": (
        flower.MultiKrum,
        {
            "num_malicious_nodes": (int, 0, "Byzantine nodes tolerated"),
            "num_nodes_to_select": (int, 1, "models averaged"),
        },
        "Flower's MultiKrum: mean of the models closest to their neighbours",
    ),
    "bulyan": (
        flower.Bulyan,
        {"num_malicious_nodes": (int, 0, "Byzantine nodes tolerated")},
        "Flower's Bulyan: Krum selection, then a trimmed mean",
    ),
    "fedtrimmedavg": (
        flower.FedTrimmedAvg,
        {"beta": (float, 0.2, "share cut from each end, in [0, 0.5)")},
        "Flower's FedTrimmedAvg: coordinate-wise trimmed mean of the models",
    ),
}


_MIN_REPLIES: dict[str, Callable[[Any], int]] = {
    "bulyan": lambda params: 4 * params.num_malicious_nodes + 3,  # Flower's Bulyan skips a round with fewer
}
_LOCAL_TRAINING = {
    "fedprox": "its proximal term has no gradient at the global model, where a one-batch client computes "
    "its one gradient, so it would be FedAvg under another name"
}


def _register_flower(name: str, cls: type, fields: dict[str, tuple[type, Any, str]], doc: str) -> None:
    params = _flower_params(f"{cls.__name__}Params", fields, doc)

    def build(context: StrategyContext, values: Any) -> Strategy:
        return cls(**context.sampling(), **dataclasses.asdict(values))

    build.__doc__ = doc
    register_strategy(
        name, params=params, local_training=_LOCAL_TRAINING.get(name, ""), min_replies=_MIN_REPLIES.get(name)
    )(build)


for _name, (_cls, _fields, _doc) in FLOWER_STRATEGIES.items():
    _register_flower(_name, _cls, _fields, _doc)


def build_strategy(name: str, protocol: str, context: StrategyContext, params: Any = None) -> Strategy:
    """The strategy ``name`` for ``protocol`` uploads: raises ``ValueError`` where it cannot aggregate them."""
    problem = protocol_problem(name, protocol)
    if problem:
        raise ValueError(problem)
    return STRATEGIES.build(resolve(name, protocol), context, params=params)
