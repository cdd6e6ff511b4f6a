"""``DefendedTraining``: the configured defense inside a Flower app's own train function, for the defenses a mod
cannot apply because they need the model and the batch (DP-SGD, Soteria, CENSOR), and for any other that defends
a FedAvg upload.

::

    guard = DefendedTraining(msg, context, net, x, y)  # net holds the model received; (x, y) the client's examples
    for batch in batches:
        guard.step(x[batch], y[batch], optimizer)  # backward and the optimizer's step
    return guard.reply({"train_loss": loss})  # the defended upload, as a reply to msg

A defense that ``defends_steps`` (DP-SGD) is followed by every ``step``: the optimizer steps along the defended
gradient of the batch (DP-SGD: the mean of per-example clipped gradients plus noise, Abadi et al.'s Algorithm 1),
each step one step of its accountant, and the upload is the model the steps reach. Any other defense is applied
by ``reply``: it gets the model received, the client's examples and the round's change ``received - trained``
(as fedguard's own FedAvg client does), and ``received - defended`` is uploaded. State lives in
``Context.state`` and randomness comes from (``run.seed``, client, round), as for the mods; the reply carries the
defense's reports, the upload's sizes and what the client declares, as ``defense_mod``'s does. Under
``train.fedbn`` (``fedbn_mod`` around the train function) the defense is given zeros at the BatchNorm entries,
which the reply carries as trained, for ``fedbn_mod`` to keep on the client.

Refiner defends one batch gradient (its traits' ``protocols`` are FedSGD's): the configuration refuses it for a
Flower app's model uploads.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn as nn
from flwr.app import Context, Message, MetricRecord, RecordDict

from clients.state import RecordState
from fedguard.defenses import LocalStep, build_defense, defense_report
from fedguard.defenses.base import defense_traits, step_gradient
from fedguard.flower.mods import DEFENSE_STATE, batch_norm_entries, defended_model, train_round, write_upload
from fedguard.flower.settings import audit_config, client_id
from fedguard.seeding import client_generators
from fedguard.training import get_arrays, loss_fn, parameters, trainable_mask
from fedguard.wire.records import NUM_EXAMPLES, array_record


class DefendedTraining:
    """One client's round of training under the configured defense (module docstring).

    Parameters
    ----------
    msg, context : Message, Context
        The train instruction and the node's context, as the app's train function gets them.
    model : nn.Module
        The app's model, holding the arrays ``msg`` carries; ``step`` trains it in place.
    x, y : Tensor
        The client's examples this round, (N, C, H, W) in [0, 1] and (N,).
    """

    def __init__(self, msg: Message, context: Context, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        self.config = audit_config(context)
        self.msg, self.model, self.x, self.y = msg, model, x, y
        self.client, self.round = client_id(context), train_round(msg)
        defense = self.config.defense
        traits = defense_traits(defense.name, defense.params)
        if traits.check_model is not None:
            traits.check_model(model)
        self.defense = build_defense(defense.name, defense.params)
        self.home = RecordState(context.state, DEFENSE_STATE)
        self.state = self.home.load(self.round)
        _, self.generator = client_generators(self.config.run.seed, self.client, self.round)
        self.every_step = traits.defends_steps
        self.gradient = step_gradient(self.defense, self.state, self.generator, self.round, self.client, len(y))
        self.received = copy.deepcopy(model)
        self.steps = 0

    def step(self, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
        """One local step on the batch (``x``, ``y``): the gradient of the training loss (the defended one, for a
        defense of every step), then ``optimizer.step()``; returns the batch's loss."""
        optimizer.zero_grad()
        if self.every_step:
            grads, loss = self.gradient(self.model, x, y)
            for p, g in zip(parameters(self.model), grads):
                p.grad = g.to(p.dtype)
        else:
            batch_loss = loss_fn(self.model(x), y)
            batch_loss.backward()
            loss = float(batch_loss.detach())
        optimizer.step()
        self.steps += 1
        return loss

    def _defended(self, names: list[str], trained: list[np.ndarray]) -> list[np.ndarray]:
        """``received - defended(received - trained)``; under ``train.fedbn`` the BatchNorm entries as trained,
        the defense given zeros there."""
        sent, trainable = get_arrays(self.received), trainable_mask(self.model)
        local = set(batch_norm_entries(names)) if self.config.train.fedbn else set()
        named = [n for n, keep in zip(names, trainable) if keep]
        change = [
            torch.zeros_like(a) if n in local else (a - b).detach()
            for n, a, b in zip(named, parameters(self.received), parameters(self.model))
        ]
        step = LocalStep(
            self.received, self.x, self.y, change, loss_fn, self.generator, self.round, self.client, len(self.y)
        )
        defended = defended_model(sent, trained, trainable, self.defense(step, self.state))
        return [t if n in local else u for n, t, u in zip(names, trained, defended)]

    def reply(self, metrics: dict[str, int | float] | None = None) -> Message:
        """The reply to the train instruction: the defended upload (``arrays``), ``metrics`` with ``num-examples``
        and the defense's reports, what the client declares; the defense's state is kept for the next round."""
        names = list(self.model.state_dict())
        trained = get_arrays(self.model)
        upload = trained if self.every_step else self._defended(names, trained)  # or the steps followed it
        self.home.store(self.round, self.state)
        content = RecordDict(
            {
                "arrays": array_record(names, upload),
                "metrics": MetricRecord({**(metrics or {}), NUM_EXAMPLES: len(self.y)}),
            }
        )
        reply = Message(content, reply_to=self.msg)
        reports = defense_report(self.defense, self.state)
        return write_upload(reply, names, upload, reports, self.config, self.client, steps=self.steps)
