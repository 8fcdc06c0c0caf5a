"""The marker behind the Ray storage check (`engine.shared_storage`); the check on a real
two-node cluster is in tests/backends/test_ray_cluster.py."""

from __future__ import annotations

from posttrain.engine.ray.shared_storage import (
    MARKER_PREFIX,
    not_shared_message,
    read_marker,
    write_marker,
)


def test_a_marker_reads_back_its_token_where_it_was_written(tmp_path):
    directory = tmp_path / "not" / "yet"  # made by the driver if missing
    marker, token = write_marker(directory)
    assert marker.parent == directory and marker.name == MARKER_PREFIX + token
    assert read_marker(str(marker)) == token
    # Each check gets a fresh name and token: a cached lookup of an earlier one cannot answer.
    again, other = write_marker(directory)
    assert other != token and again != marker


def test_a_marker_missing_here_reads_as_none(tmp_path):
    assert read_marker(str(tmp_path / f"{MARKER_PREFIX}0123")) is None
    assert read_marker(str(tmp_path)) is None  # a directory is no marker either


def test_the_refusal_names_the_directory_the_blind_ranks_and_the_fix(tmp_path):
    message = not_shared_message(tmp_path, [(0, "ab" * 28), (3, "cd" * 28)])
    assert str(tmp_path) in message
    assert (
        "rank 0 on Ray node abababababab," in message
        and "rank 3 on Ray node cdcdcdcdcdcd" in message
    )
    assert "RayBackend(path=...)" in message
