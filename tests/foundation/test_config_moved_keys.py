"""Keys that moved stop start-up with a message naming their new place, whether they come from the TOML
file, an RLBUS__ variable or a --set override: the facts of the whole run now live once in [model], [task]
and [weights], and older names of the weight transport's keys keep pointing at [weights]."""

from __future__ import annotations

import pytest

from services.rollout.config import RolloutConfig
from services.runtime.config import ConfigError, load_service_config, load_tree
from services.runtime.weights_config import BroadcastConfig, FsStoreConfig, StoreTransportConfig
from services.trainer.config import TrainerConfig


def test_old_trainer_store_key_in_the_file_names_its_replacement(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[services.trainer]\nstore = { type = "fs", root = "/w" }\n')
    with pytest.raises(ConfigError) as err:
        load_service_config("trainer", TrainerConfig, cfg, env={})
    assert str(err.value) == (
        'config key services.trainer.store was replaced by weights.store ([weights] type = "store", store = {...})')


@pytest.mark.parametrize(("env", "overrides", "old", "new"), [
    ({}, ["services.trainer.weights.anchor_every=2"], "services.trainer.weights", "weights.encoding"),
    ({}, ['services.rollout.store={type="fs",root="/w"}'], "services.rollout.store", "weights.store"),
    ({"RLBUS__SERVICES__ROLLOUT__WEIGHTS_RECHECK_S": "5"}, [], "services.rollout.weights_recheck_s",
     "weights.recheck_s"),
    ({}, ['services.trainer.transport={type="inproc"}'], "services.trainer.transport", "weights"),
    ({"RLBUS__SERVICES__ROLLOUT__MODEL": "smollm2"}, [], "services.rollout.model", "model.name"),
    ({}, ["services.trainer.task=dataset"], "services.trainer.task", "task.name"),
    ({"RLBUS__SERVICES__JUDGE__TASK_OPTIONS__DATASET__PATH": "d.jsonl"}, [], "services.judge.task_options",
     "task.options"),
    ({}, ["services.trainer.dtype=bfloat16"], "services.trainer.dtype", "model.dtype"),
    ({}, ["services.weightsync.upstream_scope=main"], "services.weightsync.upstream_scope", "weights.scope"),
], ids=["set-trainer-weights", "set-rollout-store", "env-rollout-recheck", "set-trainer-transport",
        "env-rollout-model", "set-trainer-task", "env-judge-task-options", "set-trainer-dtype",
        "set-weightsync-upstream"])
def test_old_keys_from_env_and_set_name_their_replacement(env, overrides, old, new):
    with pytest.raises(ConfigError, match=f"config key {old} was replaced by {new} "):
        load_tree(None, env=env, overrides=overrides)


def test_moved_keys_in_a_file_name_their_new_place(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[services.trainer]\nmodel = "smollm2"\n')
    with pytest.raises(ConfigError, match=r"services.trainer.model was replaced by model.name \(\[model\] name"):
        load_service_config("rollout", RolloutConfig, cfg, env={})  # any service refuses the file


def test_the_new_keys_load_and_default_to_the_store():
    loaded = load_service_config("trainer", TrainerConfig, None, env={}, overrides=[
        'weights={type="store",store={type="fs",root="/w"},encoding={anchor_every=2}}', "model.name=smollm2"])
    assert isinstance(loaded.weights, StoreTransportConfig) and loaded.model.name == "smollm2"
    assert isinstance(loaded.weights.store, FsStoreConfig) and loaded.weights.encoding.anchor_every == 2
    env = {"RLBUS__WEIGHTS__RECHECK_S": "2.5"}  # no type: the store transport
    rollout = load_service_config("rollout", RolloutConfig, None, env=env)
    assert isinstance(rollout.weights, StoreTransportConfig) and rollout.weights.recheck_s == 2.5
    default = load_service_config("trainer", TrainerConfig, None, env={}).weights
    assert isinstance(default, StoreTransportConfig)
    assert (default.retry_for_s, default.recheck_s) == (300.0, 10.0)
    broadcast = load_service_config("rollout", RolloutConfig, None, env={}, overrides=['weights.type="broadcast"'])
    assert isinstance(broadcast.weights, BroadcastConfig) and broadcast.weights.world_size == 0  # the launcher's


@pytest.mark.parametrize(("env", "overrides", "old", "new"), [
    ({}, ["services.trainer.lr=1e-5"], "services.trainer.lr", "services.trainer.optim.lr"),
    ({"RLBUS__SERVICES__TRAINER__EVAL_EVERY": "5"}, [], "services.trainer.eval_every", "services.trainer.eval.every"),
    ({"RLBUS__SERVICES__TRAINER__WORLD_SIZE": "2"}, [], "services.trainer.world_size",
     "services.trainer.devices.world_size"),
    ({}, ["services.trainer.kl_coef=0.1"], "services.trainer.kl_coef", "services.trainer.loss.kl_coef"),
], ids=["set-trainer-lr", "env-trainer-eval-every", "env-trainer-world-size", "set-trainer-kl-coef"])
def test_flat_trainer_keys_name_their_group(env, overrides, old, new):
    with pytest.raises(ConfigError, match=f"config key {old} was replaced by {new} "):
        load_tree(None, env=env, overrides=overrides)


def test_a_flat_trainer_key_in_a_file_names_its_group_and_the_grouped_keys_load(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[services.trainer]\nmax_new_tokens = 8\n")
    with pytest.raises(ConfigError, match=r"services.trainer.max_new_tokens was replaced by "
                                          r"services.trainer.sampling.max_new_tokens \(\[services.trainer.sampling\]"):
        load_service_config("trainer", TrainerConfig, cfg, env={})
    cfg.write_text("[services.trainer.sampling]\nmax_new_tokens = 8\n[services.trainer.eval]\nevery = 3\n")
    trainer = load_service_config("trainer", TrainerConfig, cfg, env={"RLBUS__SERVICES__TRAINER__OPTIM__LR": "2e-5"},
                                  overrides=["services.trainer.devices.world_size=2"]).service
    assert (trainer.sampling.max_new_tokens, trainer.eval.every, trainer.optim.lr) == (8, 3, 2e-5)
    assert trainer.devices.world_size == 2 and trainer.eval.samples == 1  # the rest of each group: defaults
