"""What a run's configuration tells the server of its model and its clients, the same for live uploads and for
captured ones read back from disk: the initial model, its card, and what a client may declare."""

from __future__ import annotations

import dataclasses

import torch

from fedguard.config import Config
from fedguard.data import load_dataset
from fedguard.data.federated import partitions
from fedguard.models import build_model
from fedguard.observation import ModelCard
from fedguard.training import trainable_mask
from strategies.upload_checks import UploadRules


def initial_model(config: Config) -> torch.nn.Module:
    """The global model at round 0, initialized from the run seed."""
    spec = load_dataset(config.data.name, config.data.source_options()).spec
    torch.manual_seed(config.run.seed)
    return build_model(config.model.name, spec, config.model.params)


def model_card(config: Config, model: torch.nn.Module) -> ModelCard:
    """What the server knows of ``model``."""
    return ModelCard(
        model=config.model.name,
        model_params=dataclasses.asdict(config.model.params),
        spec=load_dataset(config.data.name, config.data.source_options()).spec,
        names=tuple(model.state_dict()),
        trainable=tuple(trainable_mask(model)),
        data=config.data.name,
        source=config.data.source_options(),
    )


def upload_rules(config: Config, card: ModelCard) -> UploadRules:
    """What the run lets a client declare: its ``train.*`` settings, the classes and each partition's size."""
    held = partitions(
        config.data.name,
        config.data.source_options(),
        config.partition.name,
        config.partition.options(),
        config.partition.num_clients,
        config.run.seed,
    )
    return UploadRules(
        config.train.protocol,
        config.train.lr,
        config.train.batch_size,
        config.train.local_epochs,
        card.spec.num_classes,
        tuple(len(p) for p in held),
    )
