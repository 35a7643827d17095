"""Field specifiers that shape a struct's constructor: what a call takes, what
decoding still requires, and the declarations the metaclass refuses."""

from __future__ import annotations

import json

import pytest

from octo_common._struct import (
    ShapedStruct,
    constructor_default,
    laid_flat,
    leading_keyword,
    part_field,
)
from octo_common.codec import decode_struct, encode_struct
from octo_common.errors import SerializationError
from octo_common.messages import OperationCompensationBinding, OperationCompensationRequest
from octo_common.payload import ToolPayload


class Place(ShapedStruct, frozen=True):
    city: str
    zone: str


class Parcel(ShapedStruct, frozen=True):
    version: int = leading_keyword(default=5, kw_only=True)
    name: str
    city: str = part_field(init=False)
    zone: str = part_field(init=False)
    place: Place = laid_flat()
    weight: int = constructor_default(default=1)
    note: str = ""


def test_a_call_takes_the_part_and_the_wire_carries_its_fields_flat() -> None:
    here = Place("oslo", "n")
    parcel = Parcel("p", here)
    assert parcel == Parcel("p", here, 1, "", version=5)
    assert parcel == Parcel(name="p", place=here)
    assert parcel == Parcel(name="p", city="oslo", zone="n")  # flat, by keyword
    assert encode_struct(parcel) == (
        b'{"version":5,"name":"p","city":"oslo","zone":"n","weight":1,"note":""}'
    )
    assert Parcel("p", here, 3).weight == 3
    assert Parcel("p", here, version=4).version == 4


def test_constructor_defaults_and_parts_are_never_decoding_defaults() -> None:
    full = {"version": 5, "name": "p", "city": "oslo", "zone": "n", "weight": 2}
    assert decode_struct(json.dumps(full), Parcel) == Parcel("p", Place("oslo", "n"), 2)
    for field in ("weight", "zone", "version"):
        without = {key: value for key, value in full.items() if key != field}
        with pytest.raises(SerializationError):
            decode_struct(json.dumps(without), Parcel)
    # The part is a constructor parameter, not a field.
    nested = {"version": 5, "name": "p", "place": {"city": "oslo", "zone": "n"}, "weight": 2}
    with pytest.raises(SerializationError):
        decode_struct(json.dumps(nested), Parcel)


def test_a_call_that_does_not_fit_is_a_type_error() -> None:
    here = Place("oslo", "n")
    with pytest.raises(TypeError, match="takes 4 positional arguments but 5"):
        Parcel("p", here, 1, "", "extra")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values for argument 'name'"):
        Parcel("p", here, name="q")  # type: ignore[misc]
    with pytest.raises(TypeError, match="place has no 'city'"):
        Parcel("p", object())  # type: ignore[arg-type]


def test_the_metaclass_refuses_a_shape_it_cannot_read() -> None:
    with pytest.raises(TypeError, match="init"):
        part_field(init=True)
    with pytest.raises(TypeError, match="come together"):

        class NoPart(ShapedStruct, frozen=True):
            city: str = part_field(init=False)

    with pytest.raises(TypeError, match="one laid-flat part"):

        class TwoParts(ShapedStruct, frozen=True):
            city: str = part_field(init=False)
            here: Place = laid_flat()
            there: Place = laid_flat()

    with pytest.raises(TypeError, match="adds plain fields only"):

        class Reshaped(Parcel, frozen=True):
            extra: int = constructor_default(default=0)


class Labelled(Parcel, frozen=True):
    label: str = "-"


def test_a_subclass_of_a_shaped_struct_takes_its_added_fields_last() -> None:
    here = Place("oslo", "n")
    labelled = Labelled("p", here, 2, "fragile", "red")
    assert (labelled.city, labelled.weight, labelled.note, labelled.label) == (
        "oslo",
        2,
        "fragile",
        "red",
    )
    assert Labelled("p", here).label == "-"
    assert Labelled("p", here, label="x").weight == 1


def test_a_compensation_request_takes_its_binding_positionally_or_by_keyword() -> None:
    binding = OperationCompensationBinding("files.publish", "op-1", "cmp-op-1", "t", "a" * 64)
    payload = ToolPayload.text("undo")
    positional = OperationCompensationRequest("s-1", "r-1", binding, payload)
    assert positional == OperationCompensationRequest(
        session_id="s-1", request_id="r-1", binding=binding, payload=payload
    )
    assert positional.binding == binding
    assert positional.compensation_key == "cmp-op-1"
    assert positional.protocol_version == 5
