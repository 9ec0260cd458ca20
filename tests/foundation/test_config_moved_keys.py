"""One weight knob, ``transport``: the keys it replaced stop start-up with a message naming the new key,
whether they come from the TOML file, an RLBUS__ variable or a --set override."""

from __future__ import annotations

import pytest

from services.runtime.weights_config import FsStoreConfig, StoreTransportConfig
from services.rollout.config import RolloutConfig
from services.runtime.config import ConfigError, load_service_config, load_tree
from services.trainer.config import TrainerConfig


def test_old_trainer_store_key_in_the_file_names_its_replacement(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[services.trainer]\nstore = { type = "fs", root = "/w" }\n')
    with pytest.raises(ConfigError) as err:
        load_service_config("trainer", TrainerConfig, cfg, env={})
    assert str(err.value) == (
        'config key services.trainer.store was replaced by services.trainer.transport.store '
        '(transport = { type = "store", store = {...} })')


@pytest.mark.parametrize(("env", "overrides", "old", "new"), [
    ({}, ["services.trainer.weights.anchor_every=2"], "services.trainer.weights",
     "services.trainer.transport.encoding"),
    ({}, ['services.rollout.store={type="fs",root="/w"}'], "services.rollout.store",
     "services.rollout.transport.store"),
    ({"RLBUS__SERVICES__ROLLOUT__WEIGHTS_RECHECK_S": "5"}, [], "services.rollout.weights_recheck_s",
     "services.rollout.transport.recheck_s"),
    ({"RLBUS__SERVICES__TRAINER__WEIGHTS": "{dtype='bf16'}"}, [], "services.trainer.weights",
     "services.trainer.transport.encoding"),
], ids=["set-trainer-weights", "set-rollout-store", "env-rollout-recheck", "env-trainer-weights"])
def test_old_keys_from_env_and_set_name_their_replacement(env, overrides, old, new):
    with pytest.raises(ConfigError, match=f"config key {old} was replaced by {new} "):
        load_tree(None, env=env, overrides=overrides)


def test_the_new_keys_load_and_default_to_the_store():
    trainer = load_service_config("trainer", TrainerConfig, None, env={}, overrides=[
        'services.trainer.transport={type="store",store={type="fs",root="/w"},encoding={anchor_every=2}}']).service
    assert isinstance(trainer.transport, StoreTransportConfig)
    assert isinstance(trainer.transport.store, FsStoreConfig) and trainer.transport.encoding.anchor_every == 2
    env = {"RLBUS__SERVICES__ROLLOUT__TRANSPORT": "{type='store',recheck_s=2.5}"}
    rollout = load_service_config("rollout", RolloutConfig, None, env=env).service
    assert isinstance(rollout.transport, StoreTransportConfig) and rollout.transport.recheck_s == 2.5
    default = TrainerConfig().transport
    assert isinstance(default, StoreTransportConfig)
    assert (default.retry_for_s, default.recheck_s) == (300.0, 10.0)
    assert isinstance(RolloutConfig().transport, StoreTransportConfig)
