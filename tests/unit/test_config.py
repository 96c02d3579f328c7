"""Configuration: files, TF_CONFIG, environment precedence, and errors that name the field."""

import json

import pytest

from pscluster.config import load_settings, validate
from pscluster.errors import ConfigError

PS = ["127.0.0.1:7001", "127.0.0.1:7002"]


def test_yaml_toml_and_json_cluster_files(tmp_path):
    (tmp_path / "c.yaml").write_text("ps: ['127.0.0.1:7001', '127.0.0.1:7002']\n")
    (tmp_path / "c.toml").write_text('keep_checkpoints = 5\n[cluster]\nps = ["127.0.0.1:7001", "127.0.0.1:7002"]\n')
    (tmp_path / "c.json").write_text(json.dumps({"ps": PS, "coordinator": "127.0.0.1:7000"}))
    assert load_settings(tmp_path / "c.yaml", env={}).cluster.ps == PS
    toml = load_settings(tmp_path / "c.toml", env={})
    assert toml.cluster.ps == PS and toml.keep_checkpoints == 5
    assert load_settings(tmp_path / "c.json", env={}).cluster.coordinator == "127.0.0.1:7000"


def test_tf_config_maps_chief_to_coordinator_and_task():
    tf = {"cluster": {"ps": PS, "worker": ["127.0.0.1:7101"], "chief": ["127.0.0.1:7000"]},
          "task": {"type": "ps", "index": 1}}
    s = load_settings(env={"TF_CONFIG": json.dumps(tf)})
    assert s.cluster.coordinator == "127.0.0.1:7000" and s.task_type == "ps" and s.task_index == 1
    assert s.own_address() == PS[1]


def test_environment_then_overrides_win_over_file(tmp_path):
    (tmp_path / "c.yaml").write_text("cluster: {ps: ['127.0.0.1:7001']}\nnan_policy: allow\n")
    s = load_settings(tmp_path / "c.yaml", env={"PSCLUSTER_NAN_POLICY": "reject", "PSCLUSTER_TOKEN": "t0k"},
                      overrides={"keep_checkpoints": 9})
    assert s.nan_policy == "reject" and s.keep_checkpoints == 9 and s.token_value() == "t0k"


def test_token_file(tmp_path):
    (tmp_path / "tok").write_text("secret\n")
    s = load_settings(env={"TF_CONFIG": json.dumps({"cluster": {"ps": PS}}), "PSCLUSTER_TOKEN_FILE": str(tmp_path / "tok")})
    assert s.token_value() == "secret"


def test_a_token_file_others_can_read_is_used_with_a_warning_once(tmp_path, caplog):
    path = tmp_path / "tok"
    path.write_text("secret\n")
    path.chmod(0o644)
    env = {"TF_CONFIG": json.dumps({"cluster": {"ps": PS}}), "PSCLUSTER_TOKEN_FILE": str(path)}
    with caplog.at_level("WARNING", logger="pscluster.config"):
        assert load_settings(env=env).token_value() == "secret"
        load_settings(env=env)
    warnings = [r.getMessage() for r in caplog.records if "can be read by other users" in r.getMessage()]
    assert len(warnings) == 1 and "mode 644" in warnings[0] and f"chmod 600 {path}" in warnings[0]
    caplog.clear()
    private = tmp_path / "private"
    private.write_text("secret\n")
    private.chmod(0o600)
    with caplog.at_level("WARNING", logger="pscluster.config"):
        load_settings(env={**env, "PSCLUSTER_TOKEN_FILE": str(private)})
    assert not [r for r in caplog.records if "can be read by other users" in r.getMessage()]


@pytest.mark.parametrize("data,field", [
    ({"cluster": {"ps": []}}, "cluster.ps"),
    ({"cluster": {"ps": ["nohost"]}}, "cluster.ps"),
    ({"cluster": {"ps": ["127.0.0.1:99999"]}}, "cluster.ps"),
    ({"cluster": {"ps": PS}, "keep_checkpoints": 0}, "keep_checkpoints"),
    ({"cluster": {"ps": PS}, "nan_policy": "maybe"}, "nan_policy"),
    ({"cluster": {"ps": PS}, "bogus": 1}, "bogus"),
    ({"cluster": {"ps": PS}, "task_type": "ps", "task_index": 2}, "task_index 2 is out of range"),
    ({"cluster": {"ps": PS}, "bind_host": "not-an-ip"}, "bind_host"),
])
def test_bad_configuration_names_the_field(data, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(data)


def test_listening_beyond_loopback_requires_a_token():
    with pytest.raises(ConfigError, match="beyond loopback with neither a token nor TLS"):
        validate({"cluster": {"ps": PS}, "bind_host": "0.0.0.0"})
    assert validate({"cluster": {"ps": PS}, "bind_host": "0.0.0.0", "token": "x"}).bind_host == "0.0.0.0"


def test_malformed_files_and_tf_config_are_clear_errors(tmp_path):
    (tmp_path / "bad.yaml").write_text("ps: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(tmp_path / "bad.yaml", env={})
    with pytest.raises(ConfigError, match="TF_CONFIG is not valid JSON"):
        load_settings(env={"TF_CONFIG": "{"})
    with pytest.raises(ConfigError, match="no cluster spec"):
        load_settings(env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml", env={})


def test_tf_config_with_an_unknown_job_is_refused_naming_it():
    tf = {"cluster": {"ps": PS, "wrker": ["127.0.0.1:7101"]}, "task": {"type": "ps", "index": 0}}
    with pytest.raises(ConfigError, match=r"unknown job\(s\) \['wrker'\]"):
        load_settings(env={"TF_CONFIG": json.dumps(tf)})


def test_tf_config_with_two_chiefs_is_refused():
    tf = {"cluster": {"ps": PS, "chief": ["127.0.0.1:7000", "127.0.0.1:7009"]}, "task": {"type": "ps"}}
    with pytest.raises(ConfigError, match="chief lists 2 tasks"):
        load_settings(env={"TF_CONFIG": json.dumps(tf)})


def test_tf_config_with_an_unknown_task_type_is_refused():
    tf = {"cluster": {"ps": PS}, "task": {"type": "master", "index": 0}}
    with pytest.raises(ConfigError, match="task.type 'master'"):
        load_settings(env={"TF_CONFIG": json.dumps(tf)})


def test_tf_config_with_an_evaluator_job_is_accepted():
    tf = {"cluster": {"ps": PS, "chief": ["127.0.0.1:7000"], "evaluator": ["127.0.0.1:7200"]},
          "task": {"type": "ps", "index": 0}}
    assert load_settings(env={"TF_CONFIG": json.dumps(tf)}).cluster.coordinator == "127.0.0.1:7000"


def test_token_from_the_environment_when_no_file_is_given(tmp_path):
    from pscluster.config import load_token

    assert load_token(None, {"PSCLUSTER_TOKEN": "t0k"}) == "t0k"
    (tmp_path / "tok").write_text("filed\n")
    assert load_token(tmp_path / "tok", {"PSCLUSTER_TOKEN": "t0k"}) == "filed"
    assert load_token(None, {}) is None


def test_socket_timeout_has_a_default_an_environment_variable_and_a_lower_bound():
    tf = json.dumps({"cluster": {"ps": PS}})
    assert load_settings(env={"TF_CONFIG": tf}).socket_timeout_s == 30.0
    assert load_settings(env={"TF_CONFIG": tf, "PSCLUSTER_SOCKET_TIMEOUT_S": "5"}).socket_timeout_s == 5.0
    with pytest.raises(ConfigError, match="socket_timeout_s"):
        load_settings(env={"TF_CONFIG": tf, "PSCLUSTER_SOCKET_TIMEOUT_S": "0"})


@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_an_empty_token_file_is_refused_not_taken_as_no_token(tmp_path, content):
    (tmp_path / "tok").write_text(content)
    with pytest.raises(ConfigError, match="token_file .*tok is empty"):
        load_settings(None, env={"TF_CONFIG": "", "PSCLUSTER_TOKEN_FILE": str(tmp_path / "tok")},
                      overrides={"cluster": {"ps": PS}, "bind_host": "0.0.0.0"})


@pytest.mark.parametrize("token", ["", "   "])
def test_an_empty_token_is_refused_from_the_environment_and_from_a_cluster_file(token):
    from pscluster.config import load_token

    with pytest.raises(ConfigError, match="PSCLUSTER_TOKEN is set but empty"):
        load_token(None, {"PSCLUSTER_TOKEN": token})
    with pytest.raises(ConfigError, match="token is empty, which would turn authentication off"):
        validate({"cluster": {"ps": PS}, "bind_host": "0.0.0.0", "token": token})


def test_tf_config_evaluator_task_is_the_evaluator_role():
    tf = json.dumps({"cluster": {"chief": ["127.0.0.1:7000"], "ps": PS, "evaluator": ["127.0.0.1:7010"]},
                     "task": {"type": "evaluator", "index": 0}})
    s = load_settings(None, env={"TF_CONFIG": tf})
    assert s.task_type == "evaluator" and s.cluster.coordinator == "127.0.0.1:7000"


def test_a_setting_beside_the_addresses_of_a_bare_cluster_file_says_where_it_goes(tmp_path):
    bare = tmp_path / "cluster.yaml"
    bare.write_text('ps: ["127.0.0.1:7001", "127.0.0.1:7002"]\ncoordinator: "127.0.0.1:7000"\nreplicas: 2\n')
    with pytest.raises(ConfigError, match=r"cluster\.replicas: .*`replicas` is a setting; .*top-level `cluster:` key"):
        load_settings(bare)
    full = tmp_path / "full.yaml"
    full.write_text('cluster:\n  ps: ["127.0.0.1:7001", "127.0.0.1:7002"]\n  coordinator: "127.0.0.1:7000"\nreplicas: 2\n')
    assert load_settings(full).replicas == 2


@pytest.mark.parametrize("replicas", [0, 3])
def test_replicas_out_of_range_says_which_counts_are_supported(replicas):
    with pytest.raises(ConfigError, match=rf"replicas: {replicas}: only 1 or 2 copies are supported"):
        validate({"cluster": {"ps": PS}, "replicas": replicas})


@pytest.mark.parametrize("data,hint", [
    ({"cluster": {"ps": PS}, "replica": 2}, "replica: Extra inputs are not permitted (got 2): did you mean 'replicas'?"),
    ({"cluster": {"ps": PS, "coordinater": "127.0.0.1:1"}}, "did you mean 'coordinator'?"),
])
def test_a_mistyped_key_gets_the_closest_field(data, hint):
    with pytest.raises(ConfigError) as info:
        validate(data)
    assert hint in str(info.value)


def test_an_unknown_key_like_no_field_gets_no_guess():
    with pytest.raises(ConfigError) as info:
        validate({"cluster": {"ps": PS}, "zzzzzz": 1})
    assert "did you mean" not in str(info.value)
