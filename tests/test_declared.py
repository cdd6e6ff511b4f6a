"""The declared record: one typed form the client fills, the wire carries and the server and the attacks read."""

from __future__ import annotations

import dataclasses

import pytest

from fedguard.wire.declared import FIELD_TYPES, KEYS, WIRE_KEYS, Declared, wire_key


def test_every_field_has_a_type_and_a_wire_key_with_dashes() -> None:
    names = [f.name for f in dataclasses.fields(Declared) if f.name != "extra"]
    assert list(FIELD_TYPES) == names and list(WIRE_KEYS) == names
    assert wire_key("batch_size") == "batch-size" and wire_key("proximal_mu") == "proximal-mu"
    assert wire_key("encoding") == "encoding" and len(KEYS) == len(names)
    with pytest.raises(KeyError):
        wire_key("batch-size")


def test_the_wire_form_reads_back_to_the_same_record_and_leaves_out_what_was_not_declared() -> None:
    declared = Declared(
        client=3, protocol="fedavg", lr=0.1, batch_size=8, local_epochs=2, local_steps=4, loss=0.7,
        labels=(1, 0, 2), upload_bytes=100, dense_bytes=400, extra={"defense.raw": 1.0},
    )  # fmt: skip
    wire = declared.record()
    assert wire == {
        "client": 3, "protocol": "fedavg", "lr": 0.1, "batch-size": 8, "local-epochs": 2, "local-steps": 4,
        "loss": 0.7, "labels": [1, 0, 2], "upload-bytes": 100, "dense-bytes": 400, "defense.raw": 1.0,
    }  # fmt: skip
    assert Declared.read(wire) == declared
    assert Declared().record() == {}


def test_reading_converts_json_numbers_and_refuses_a_value_of_the_wrong_type_by_name() -> None:
    assert Declared.read({"lr": 1, "batch-size": 4}).lr == 1.0
    assert Declared.read({"labels": "3,1,4"}).labels == (3, 1, 4), "observation files of an older form"
    for record, message in [
        ({"batch-size": True}, "declared batch-size = 'True': expected int"),
        ({"lr": "fast"}, "declared lr = 'fast': expected float"),
        ({"labels": [1, 2.5]}, "declared labels = '[1, 2.5]': expected a list of integers"),
        ({"protocol": 3}, "declared protocol = '3': expected str"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            Declared.read(record)


def test_the_batch_is_the_declared_one_else_every_example() -> None:
    assert Declared(batch_size=4).batch(32) == 4 and Declared().batch(32) == 32
