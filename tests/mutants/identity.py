"""Mutants of the worker identity used in file names (fd-spec §1.4, rule 12)."""
from __future__ import annotations

import os

from .base import Mutant


class GpuOrdinalAsId(Mutant):
    id = "gpu_ordinal_as_id"
    bug = ("file id taken from FLAGS_selected_gpus (the ordinal) instead of the physical GPU in "
           "CUDA_VISIBLE_DEVICES: with CUDA_VISIBLE_DEVICES=2,3,4 the worker reads tp0.1 instead of tp0.3")
    kills = frozenset({"SNAP-GPU-ID"})

    def patches(self):
        return {"reference.identity.physical_gpu_id": lambda env=None: int((env or os.environ).get("FLAGS_selected_gpus", "0"))}


class BareIntGpuId(Mutant):
    id = "bare_int_gpu_id"
    bug = ("int(CUDA_VISIBLE_DEVICES.split(',')[int(FLAGS_selected_gpus)]) with no check: a UUID entry gives "
           "\"invalid literal for int()\" and an out-of-range selection a bare IndexError, neither naming the variable")
    kills = frozenset({"SNAP-GPU-ID-INVALID"})

    def patches(self):
        def physical_gpu_id(env=None):
            env = os.environ if env is None else env
            return int(env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[int(env.get("FLAGS_selected_gpus", "0"))])

        return {"reference.identity.physical_gpu_id": physical_gpu_id}


def _env(env):
    return os.environ if env is None else env


class GpuFirstVisibleEntry(Mutant):
    id = "gpu_first_visible_entry"
    bug = ("file id taken as the first CUDA_VISIBLE_DEVICES entry, ignoring FLAGS_selected_gpus (right for the "
           "one-GPU-per-process launch where the list has one entry, wrong for the middle and last entries)")
    kills = frozenset({"SNAP-GPU-ID", "SNAP-GPU-ID-INVALID"})

    def patches(self):
        return {"reference.identity.physical_gpu_id": lambda env=None: int(_env(env).get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])}


class LegacyNameUsesOrdinal(Mutant):
    id = "legacy_name_uses_ordinal"
    bug = ("the legacy tp0{id} name still built from FLAGS_selected_gpus (the pre-#6852 get_gpu_id kept for the "
           "legacy branch) while the new names use the physical id: tp01 read instead of tp03")
    kills = frozenset({"SNAP-GPU-ID", "SNAP-RANK-OWN-SHARD"})

    def patches(self):
        from reference import snapshot_plan

        real = snapshot_plan.base_names

        def base_names(rank, gpu_id):
            ordinal = int(os.environ.get("FLAGS_selected_gpus", "0"))
            return real(rank, gpu_id)[0], f"model_state.tp0{ordinal}"

        return {"reference.snapshot_plan.base_names": base_names}


class GpuIdAllEntriesParsed(Mutant):
    id = "gpu_id_all_entries_parsed"
    bug = ("every CUDA_VISIBLE_DEVICES entry converted with int() before indexing ([int(v) for v in "
           "visible.split(',')][sel]): a UUID or MIG entry that is not this worker's makes the worker fail")
    kills = frozenset({"SNAP-GPU-ID-INVALID"})

    def patches(self):
        def physical_gpu_id(env=None):
            env = _env(env)
            try:
                ids = [int(v) for v in env.get("CUDA_VISIBLE_DEVICES", "0").split(",")]
            except ValueError as e:
                raise ValueError(f"CUDA_VISIBLE_DEVICES must list GPU indices: {e}") from None
            return ids[int(env.get("FLAGS_selected_gpus", "0"))]

        return {"reference.identity.physical_gpu_id": physical_gpu_id}


class NegativeSelectionWraps(Mutant):
    id = "negative_selection_wraps"
    bug = ("FLAGS_selected_gpus parsed with int() and bounds-checked only from above: -1 indexes the last "
           "CUDA_VISIBLE_DEVICES entry (Python wrap-around) and the worker loads GPU 7's files")
    kills = frozenset({"SNAP-GPU-ID-INVALID"})

    def patches(self):
        from reference.errors import GpuIdError

        def physical_gpu_id(env=None):
            env = _env(env)
            visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "0").split(",")]
            try:
                selected = int(env.get("FLAGS_selected_gpus", "0"))
            except ValueError:
                raise GpuIdError("FLAGS_selected_gpus is not an integer") from None
            if selected >= len(visible):
                raise GpuIdError(f"FLAGS_selected_gpus={selected} out of range")
            entry = visible[selected]
            if not entry.isdigit():
                raise GpuIdError(f"CUDA_VISIBLE_DEVICES entry {entry!r} is not an index")
            return int(entry)

        return {"reference.identity.physical_gpu_id": physical_gpu_id}


class GpuIdUnstripped(Mutant):
    id = "gpu_id_unstripped"
    bug = ("entries checked with str.isdigit() without stripping: 'CUDA_VISIBLE_DEVICES= 5, 3 ,7' (as a shell "
           "script or a YAML list writes it) is rejected although int() and CUDA read it")
    kills = frozenset({"SNAP-GPU-ID-INVALID"})

    def patches(self):
        from reference.errors import GpuIdError

        def physical_gpu_id(env=None):
            env = _env(env)
            visible = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")
            selected = env.get("FLAGS_selected_gpus", "0")
            if not selected.isdigit() or int(selected) >= len(visible):
                raise GpuIdError(f"FLAGS_selected_gpus={selected!r} is not an index into CUDA_VISIBLE_DEVICES")
            entry = visible[int(selected)]
            if not entry.isdigit():
                raise GpuIdError(f"CUDA_VISIBLE_DEVICES entry {entry!r} is not a GPU index")
            return int(entry)

        return {"reference.identity.physical_gpu_id": physical_gpu_id}


class UuidFallsBackToOrdinal(Mutant):
    id = "uuid_falls_back_to_ordinal"
    bug = ("a non-numeric CUDA_VISIBLE_DEVICES entry (UUID, MIG, empty) 'tolerated' by using the ordinal "
           "FLAGS_selected_gpus as the id: the worker silently loads another GPU's files")
    kills = frozenset({"SNAP-GPU-ID-INVALID"})

    def patches(self):
        from reference import identity

        real = identity.physical_gpu_id

        def physical_gpu_id(env=None):
            try:
                return real(env)
            except ValueError as e:
                if "CUDA_VISIBLE_DEVICES entry" in str(e):
                    return int(_env(env).get("FLAGS_selected_gpus", "0"))
                raise

        return {"reference.identity.physical_gpu_id": physical_gpu_id}


class RankIsLocalOrdinal(Mutant):
    id = "rank_is_local_ordinal"
    bug = ("rank taken as the local device ordinal (FLAGS_selected_gpus / LOCAL_RANK) instead of the global "
           "PADDLE_TRAINER_ID: equal on one node with rank r on ordinal r, wrong on every other layout")
    kills = frozenset({"SNAP-GPU-ID", "SNAP-NAME-SINGLE", "SNAP-RANK-OWN-SHARD", "SNAP-IDENTITY-AT-OPEN"})

    def patches(self):
        return {"reference.identity.global_rank": lambda: int(os.environ.get("FLAGS_selected_gpus", "0"))}


class IdentityReadAtUpdate(Mutant):
    id = "identity_read_at_update"
    bug = ("rank and GPU id read from the process environment when update() runs instead of when the session "
           "is opened: two workers in one process, or an environment changed since, load another worker's files")
    kills = frozenset({"SNAP-IDENTITY-AT-OPEN"})

    def patches(self):
        from reference import identity, snapshot

        real = snapshot.update_from_snapshot

        def update_from_snapshot(manager):
            from paddle.distributed import parallel

            parallel._global_parallel_env = None
            manager.rank, manager.gpu_id = identity.global_rank(), identity.physical_gpu_id()
            return real(manager)

        return {"reference.snapshot.update_from_snapshot": update_from_snapshot}
