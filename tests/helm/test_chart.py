"""The Helm chart, rendered and linted by the Helm library (helm-python-sdk, no CLI or cluster).

Rendered RayService/RayJob objects are checked against KubeRay's CRD schemas (from the shared
folder next to the repository, or HYBRIDSERVE_KUBERAY_CRDS; a test that needs them fails when
they are absent, it never passes unchecked), built-in kinds with kubernetes-validate, and the
serve config inside against our own `LLMServingArgs`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.config import (
    API_KEY_ENV,
    PVC_MOUNT_ROOT,
    LLMConfig,
    LLMServingArgs,
    validate_config_file,
    validate_engine_kwargs,
)
from cluster.config.autoscaling import HYBRID_POLICY
from cluster.config.pd_args import PDServingArgs
from cluster.serve.batch_store import BATCH_DIR_ENV
from tests.helpers.readme import code_block

if sys.platform == "linux" and platform.machine() == "x86_64":
    import helm_python as helm  # a dev dependency wherever its wheel exists
else:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk ships linux x86-64 only")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "hybridserve"
CRDS = Path(os.environ.get("HYBRIDSERVE_KUBERAY_CRDS", ROOT.parent / "shared" / "kuberay-crds"))
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayJob": "ray.io_rayjobs.yaml"}

TP2 = {"engine": {"tensorParallelSize": 2, "maxModelLen": 8192}, "worker": {"gpusPerPod": 2}}
FULL = {
    "model": {"source": "pvc://weights/qwen/0.5b", "hfToken": {"secretName": "hf-token"}},
    "engine": {"extraKwargs": {"max_num_seqs": 64, "block_size": 32, "download_dir": "/w/hub"}},
    "serve": {"grpc": {"enabled": True}, "apiKey": {"secretName": "api-key"}},
    "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "targetOngoingRequests": 16},
    "worker": {"acceleratorType": "H100", "minReplicas": 1, "maxReplicas": 3,
               "env": [{"name": "HF_HOME", "value": "/override"}]},
    "modelCache": {"enabled": True, "storageClass": "fast"},
}  # fmt: skip
BATCH = {"mode": "batch", "batch": {"replicas": 2, "extraArgs": ["--continue-on-error"],
                                    "dataVolume": {"claimName": "batch-data"}}}  # fmt: skip
CPU = yaml.safe_load((CHART / "values-cpu.yaml").read_text())  # the CPU preset, as `-f` gives it
KV_OFFLOAD = {"kvOffload": {"sizeGiB": 8, "disk": {"sizeGiB": 100, "hostPath": "/mnt/kv"}}}
BATCH_STORE = {"batchStore": {"enabled": True, "storageClass": "nfs", "mountPath": "/srv/batches"}}
AUTOSCALED = {
    "autoscaling": {
        "minReplicas": 1, "maxReplicas": 4, "initialReplicas": 2, "targetOngoingRequests": 64,
        "upscaleDelayS": 10, "downscaleDelayS": 120, "lookBackPeriodS": 15,
        "hybridPolicy": {"enabled": True, "metrics": ["kv_pressure", "queue_len"],
                         "targetKvPressure": 0.9, "targetQueueLen": 4, "targetTtftS": 1.5},
    },
    "worker": {"minReplicas": 1, "maxReplicas": 4},
}  # fmt: skip
CASES = {
    "service-default": {},
    "service-autoscaled": AUTOSCALED,
    "service-kv-offload": KV_OFFLOAD,
    "service-batch-store": BATCH_STORE,
    "service-cpu": CPU,
    "service-tp2": TP2,
    "service-full": FULL,
    "batch-default": {"mode": "batch"},
    "batch-tp2": {**TP2, **BATCH},
}


@functools.cache
def _chart() -> Any:
    return helm.Chart.load(str(CHART))


def _render_files(values: dict[str, Any]) -> dict[str, str]:
    return _chart().render(copy.deepcopy(values), name="demo", namespace="llm")  # type: ignore[no-any-return]


def _render(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rendered objects by kind and name suffix: `RayService`, `ConfigMap/dashboard`, ..."""
    objects = {}
    for path, text in _render_files(values).items():
        if path.endswith(".txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                suffix = doc["metadata"]["name"].removeprefix("demo-hybridserve").lstrip("-")
                objects[f"{doc['kind']}/{suffix}" if suffix else doc["kind"]] = doc
    return objects


def _strict(schema: Any) -> Any:
    """kubeconform --strict for CRD schemas: objects with listed properties accept no others."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_strict(item) for item in schema]
    return schema


@functools.cache
def _crd_validator(kind: str) -> Any:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def _validate_object(obj: dict[str, Any]) -> None:
    if obj["kind"] in CRD_FILES:
        if not CRDS.is_dir():
            pytest.fail(f"KubeRay CRDs not found at {CRDS} (set HYBRIDSERVE_KUBERAY_CRDS)")
        errors = [
            f"{list(e.path)}: {e.message}" for e in _crd_validator(obj["kind"]).iter_errors(obj)
        ]
        assert not errors, errors
    else:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def _serving_args(rayservice: dict[str, Any]) -> LLMServingArgs:
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    assert app["import_path"] == "cluster.serve:build_openai_app"
    return LLMServingArgs.model_validate(app["args"])


def test_chart_lints_clean() -> None:
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_match_their_schemas(case: str) -> None:
    objects = _render(CASES[case])
    assert ("RayJob" if case.startswith("batch") else "RayService") in objects
    # Built-in kinds first: a missing CRD folder then fails after them.
    for obj in sorted(objects.values(), key=lambda obj: obj["kind"] in CRD_FILES):
        _validate_object(obj)


def test_schema_checks_catch_unknown_fields_and_wrong_types() -> None:
    objects = _render({})
    config_map = copy.deepcopy(objects["ConfigMap/dashboard"])
    config_map["datum"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_object(config_map)
    rayservice = copy.deepcopy(objects["RayService"])
    rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    with pytest.raises(AssertionError, match="'rayStartParam' was unexpected"):
        _validate_object(rayservice)
    rayservice = copy.deepcopy(objects["RayService"])
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"
    with pytest.raises(AssertionError, match="'one' is not of type 'integer'"):
        _validate_object(rayservice)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("service")])
def test_serve_config_passes_our_own_validation(case: str, tmp_path: Path) -> None:
    rayservice = _render(CASES[case])["RayService"]
    serve_config = tmp_path / "serve.yaml"
    serve_config.write_text(rayservice["spec"]["serveConfigV2"])
    model_id = CASES[case].get("model", {}).get("id", "smollm2-135m")
    assert validate_config_file(serve_config) == [model_id]
    (config,) = _serving_args(rayservice).llm_configs
    validate_engine_kwargs(config.engine_kwargs)
    assert config.model_id == model_id
    tp_size = CASES[case].get("engine", {}).get("tensorParallelSize", 1)
    assert config.engine_args().tensor_parallel_size == tp_size
    assert len(config.placement_bundles(use_gpu=True)) == tp_size


def test_tp2_values_reach_engine_kwargs_and_gpu_requests() -> None:
    rayservice = _render(TP2)["RayService"]
    (config,) = _serving_args(rayservice).llm_configs
    assert config.engine_kwargs["max_model_len"] == 8192
    worker = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["rayStartParams"]["num-gpus"] == "2"
    (container,) = worker["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_cpu_preset_serves_the_image_default_model_on_cpu_only_workers() -> None:
    rayservice = _render(CPU)["RayService"]
    (config,) = _serving_args(rayservice).llm_configs
    args = config.engine_args()
    assert args.model == CPU["model"]["source"]  # an absolute path: nothing to download
    assert args.kv_cache_memory_bytes == 256 * 2**20
    cluster_spec = rayservice["spec"]["rayClusterConfig"]
    (worker,) = cluster_spec["workerGroupSpecs"]
    assert worker["rayStartParams"]["num-gpus"] == "0"
    for pod in _pods(cluster_spec):
        (container,) = pod["containers"]
        assert container["image"] == f"ghcr.io/hybridserve/hybridserve:{_chart_version()}-cpu"
        resources = json.dumps(container["resources"])
        assert "nvidia.com/gpu" not in resources
        assert container["resources"]["limits"]["memory"] in ("3Gi", "4Gi")


def _chart_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def _pods(cluster_spec: dict[str, Any]) -> list[dict[str, Any]]:
    groups = [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]
    return [group["template"]["spec"] for group in groups]


def test_full_values_wire_secrets_volumes_grpc_and_accelerator() -> None:
    rayservice = _render(FULL)["RayService"]
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert serve_config["grpc_options"] == {
        "port": 9000,
        "grpc_servicer_functions": [
            "cluster.serve.grpc.llm_pb2_grpc.add_LLMServiceServicer_to_server"
        ],
    }
    assert serve_config["http_options"]["port"] == 8000
    (config,) = _serving_args(rayservice).llm_configs
    assert config.engine_args().model == f"{PVC_MOUNT_ROOT}/weights/qwen/0.5b"
    assert config.engine_kwargs["max_num_seqs"] == 64
    assert config.engine_args().download_dir == "/w/hub"
    assert config.accelerator_type == "H100"
    assert config.deployment_config["autoscaling_config"]["max_replicas"] == 3
    grace = config.deployment_config["graceful_shutdown_timeout_s"]
    head, *_ = pods = _pods(rayservice["spec"]["rayClusterConfig"])
    for pod in pods:
        assert pod["terminationGracePeriodSeconds"] > grace
        (container,) = pod["containers"]
        env = {
            e["name"]: e.get("valueFrom", {}).get("secretKeyRef") or e["value"]
            for e in container["env"]
        }
        assert env["HF_TOKEN"] == {"name": "hf-token", "key": "hf_token"}
        assert env[API_KEY_ENV] == {"name": "api-key", "key": "api_key"}
        # worker.env comes last, so that it overrides the chart's own variables
        assert env["HF_HOME"] == ("/models" if pod is head else "/override")
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert (
            volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
            == "demo-hybridserve-model-cache"
        )
        assert (
            volumes[mounts[f"{PVC_MOUNT_ROOT}/weights"]]["persistentVolumeClaim"]["claimName"]
            == "weights"
        )
        assert {"name": "grpc", "containerPort": 9000} in container["ports"]
    assert rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_autoscaling_values_render_the_hybrid_policy_into_the_serve_config() -> None:
    (config,) = _serving_args(_render(AUTOSCALED)["RayService"]).llm_configs
    assert config.deployment_config["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 2,
        "target_ongoing_requests": 64,
        "upscale_delay_s": 10,
        "downscale_delay_s": 120,
        "look_back_period_s": 15,
        "policy": {
            "policy_function": HYBRID_POLICY,
            "policy_kwargs": {
                "metrics": ["kv_pressure", "queue_len"],
                "target_kv_pressure": 0.9,
                "target_queue_len": 4,
                "target_ttft_s": 1.5,
            },
        },
    }


def test_autoscaling_off_fixes_the_replicas_and_the_hybrid_switch_picks_the_policy() -> None:
    fixed = _render({"autoscaling": {"enabled": False, "minReplicas": 2, "maxReplicas": 2}})
    (config,) = _serving_args(fixed["RayService"]).llm_configs
    assert config.deployment_config["num_replicas"] == 2
    assert "autoscaling_config" not in config.deployment_config
    serve_default = _render({"autoscaling": {"hybridPolicy": {"enabled": False}}})
    (config,) = _serving_args(serve_default["RayService"]).llm_configs
    assert "policy" not in config.deployment_config["autoscaling_config"]


def test_the_documented_autoscaled_values_render_the_hybrid_policy() -> None:
    values = yaml.safe_load(code_block("hybridPolicy:", "yaml", "docs/kubernetes.md"))
    (config,) = _serving_args(_render(values)["RayService"]).llm_configs
    autoscaling = config.deployment_config["autoscaling_config"]
    assert (autoscaling["max_replicas"], autoscaling["policy"]["policy_function"]) == (
        4,
        HYBRID_POLICY,
    )


def test_kv_offload_values_reach_engine_kwargs_and_put_the_disk_level_on_a_volume() -> None:
    rayservice = _render(KV_OFFLOAD)["RayService"]
    (config,) = _serving_args(rayservice).llm_configs
    args = config.engine_args()
    assert (args.kv_offloading_backend, args.kv_offloading_size) == ("native", 8)
    assert (args.kv_offloading_dir, args.kv_offloading_disk_size) == (
        "/var/cache/hybridserve-kv",
        100,
    )
    for pod in _pods(rayservice["spec"]["rayClusterConfig"]):
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = {v["name"]: v for v in pod["volumes"]}[mounts["/var/cache/hybridserve-kv"]]
        assert volume["hostPath"] == {"path": "/mnt/kv", "type": "DirectoryOrCreate"}
    default = _serving_args(_render({})["RayService"]).llm_configs[0].engine_args()
    assert default.kv_offloading_size is None


def _batch_store_mounts(values: dict[str, Any]) -> list[tuple[str | None, str | None]]:
    """Per Ray pod: (HYBRIDSERVE_BATCH_DIR, the claim mounted there)."""
    objects = _render(values)
    kind = "RayService" if "RayService" in objects else "RayJob"
    spec = objects[kind]["spec"]
    found = []
    for pod in _pods(spec["rayClusterConfig"] if kind == "RayService" else spec["rayClusterSpec"]):
        (container,) = pod["containers"]
        folder = {e["name"]: e.get("value") for e in container["env"]}.get(BATCH_DIR_ENV)
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        volume = volumes.get(mounts.get(folder or "", ""), {})
        found.append((folder, volume.get("persistentVolumeClaim", {}).get("claimName")))
    return found


def test_batch_store_values_mount_a_claim_at_the_batch_folder_on_every_pod() -> None:
    objects = _render(BATCH_STORE)
    assert set(_batch_store_mounts(BATCH_STORE)) == {
        ("/srv/batches", "demo-hybridserve-batch-store")
    }
    claim = objects["PersistentVolumeClaim/batch-store"]["spec"]
    assert (claim["storageClassName"], claim["accessModes"]) == ("nfs", ["ReadWriteMany"])
    existing = {"batchStore": {"enabled": True, "existingClaim": "shared-batches"}}
    assert set(_batch_store_mounts(existing)) == {
        ("/var/lib/hybridserve/batches", "shared-batches")
    }
    assert "PersistentVolumeClaim/batch-store" not in _render(existing)
    assert set(_batch_store_mounts({})) == {(None, None)}  # Ray's object store
    assert set(_batch_store_mounts({**BATCH_STORE, "mode": "batch"})) == {(None, None)}


CACHE_DTYPES = {
    "kv_cache_dtype": "fp8_e5m2",
    "calculate_kv_scales": True,
    "mamba_ssm_cache_dtype": "float32",
    "quantization": "fp8",
}


def test_cache_dtype_and_quantization_values_reach_engine_kwargs() -> None:
    rayservice = _render({"engine": {"extraKwargs": CACHE_DTYPES}})["RayService"]
    (config,) = _serving_args(rayservice).llm_configs
    assert config.engine_args().model_dump(include=set(CACHE_DTYPES)) == CACHE_DTYPES


def test_an_unknown_kv_cache_dtype_renders_but_fails_our_validation() -> None:
    rayservice = _render({"engine": {"extraKwargs": {"kv_cache_dtype": "fp4"}}})["RayService"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _serving_args(rayservice).llm_configs[0].engine_args()


def test_lora_values_reach_lora_config_and_engine_kwargs() -> None:
    values = {"lora": {"dynamicLoraLoadingPath": "/models/adapters", "maxLoras": 4}}
    (config,) = _serving_args(_render(values)["RayService"]).llm_configs
    assert config.lora_config is not None
    assert config.lora_config.dynamic_lora_loading_path == "/models/adapters"
    args = config.engine_args()
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (
        True,
        4,
        16,
        16,
    )
    assert _serving_args(_render({})["RayService"]).llm_configs[0].lora_config is None


def test_batch_mode_renders_a_rayjob_running_the_batch_entry_point() -> None:
    objects = _render({**TP2, **BATCH})
    assert "RayService" not in objects
    job = objects["RayJob"]
    assert job["spec"]["entrypoint"] == (
        "python -m cluster.batch --input '/data/in.jsonl' --output '/data/out' "
        "--config /etc/hybridserve/llm.yaml --replicas 2 '--continue-on-error'"
    )
    config = LLMConfig.model_validate(
        yaml.safe_load(objects["ConfigMap/llm-config"]["data"]["llm.yaml"])
    )
    assert config.tensor_parallel_size == 2
    head, worker = _pods(job["spec"]["rayClusterSpec"])
    head_mounts = {m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert {"/etc/hybridserve", "/data", "/dev/shm"} <= head_mounts
    assert "/data" in {m["mountPath"] for m in worker["containers"][0]["volumeMounts"]}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engine": {"tensorParallelSize": 0}},
         "at '/engine/tensorParallelSize': minimum: got 0, want 1"),
        ({"mode": "foo"}, "at '/mode': value must be one of 'service', 'batch'"),
        ({"model": {"source": None}}, "at '/model': missing property 'source'"),
        ({"model": {"source": "s3://bucket/model"}},
         "at '/model/source': 's3://bucket/model' does not match"),
        ({"worker": {"gpusPerPod": "two"}}, "at '/worker/gpusPerPod': got string, want integer"),
        ({"engnie": {}}, "additional properties 'engnie' not allowed"),
        ({"engine": {"tensorParallelSize": 4}},
         "engine.tensorParallelSize=4 needs 4 GPUs but "
         "worker.gpusPerPod x worker.maxReplicas gives 1"),
        ({"engine": {"extraKwargs": {"tensor_parallel_size": 2}}},
         "engine.extraKwargs.tensor_parallel_size: set it through its own engine value"),
        ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
         "autoscaling.maxReplicas=2 is below autoscaling.minReplicas=3"),
        ({"autoscaling": {"maxReplicas": 2, "initialReplicas": 3}},
         "autoscaling.initialReplicas=3 is outside autoscaling.minReplicas=1 .. "
         "autoscaling.maxReplicas=2"),
        ({"autoscaling": {"upscaleDelayS": -1}},
         "at '/autoscaling/upscaleDelayS': minimum: got -1, want 0"),
        ({"autoscaling": {"downscaleDelayS": "ten"}},
         "at '/autoscaling/downscaleDelayS': got string, want number"),
        ({"autoscaling": {"hybridPolicy": {"targetKvPressure": 1.5}}},
         "at '/autoscaling/hybridPolicy/targetKvPressure': maximum: got 1.5, want 1"),
        ({"autoscaling": {"hybridPolicy": {"targetKvPressure": 0}}},
         "at '/autoscaling/hybridPolicy/targetKvPressure': exclusiveMinimum: got 0, want 0"),
        ({"autoscaling": {"hybridPolicy": {"metrics": ["kv_pressure", "gpu_util"]}}},
         "at '/autoscaling/hybridPolicy/metrics/1': value must be one of"),
        ({"autoscaling": {"hybridPolicy": {"metrics": []}}},
         "at '/autoscaling/hybridPolicy/metrics': minItems: got 0, want 1"),
        ({"autoscaling": {"hybirdPolicy": {}}}, "additional properties 'hybirdPolicy' not allowed"),
    ],
)  # fmt: skip
def test_bad_values_fail_rendering_naming_the_value(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        _render_files(values)
    assert message in str(info.value)


def test_misspelt_engine_kwarg_renders_but_fails_our_validation() -> None:
    rayservice = _render({"engine": {"extraKwargs": {"max_num_seq": 8}}})["RayService"]
    with pytest.raises(ValueError, match=r"did you mean 'max_num_seqs'\?"):
        _serving_args(rayservice)


def test_request_router_values_reach_the_model_deployment() -> None:
    router = "cluster.serve.routing:HybridPrefixRouter"
    values = {"serve": {"requestRouter": {"class": router, "kwargs": {"load_factor": 1.5}}}}
    (config,) = _serving_args(_render(values)["RayService"]).llm_configs
    assert config.deployment_config["request_router_config"] == {
        "request_router_class": router,
        "request_router_kwargs": {"load_factor": 1.5},
    }
    (default,) = _serving_args(_render({})["RayService"]).llm_configs
    assert "request_router_config" not in default.deployment_config


@pytest.mark.parametrize(("ingress", "flag"), [(None, "1"), ("haproxy", "1"), ("proxy", "0")])
def test_ingress_value_sets_haproxy_mode_on_every_pod(ingress: str | None, flag: str) -> None:
    values = {} if ingress is None else {"serve": {"ingress": ingress}}
    rayservice = _render(values)["RayService"]
    for pod in _pods(rayservice["spec"]["rayClusterConfig"]):
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == flag


def test_prefill_decode_values_render_the_pd_app() -> None:
    pd = {"enabled": True, "kvTransferTimeoutS": 12, "kvTransferTransport": "direct"}
    rayservice = _render({"serve": {"prefillDecode": pd}})["RayService"]
    _validate_object(rayservice)
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "cluster.serve:build_pd_openai_app"
    args = PDServingArgs.model_validate(app["args"])
    assert args.kv_transfer_timeout_s == 12
    assert args.prefill_config == args.decode_config
    assert args.prefill_config.engine_kwargs["kv_transfer_transport"] == "direct"
