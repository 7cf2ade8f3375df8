"""Mutants of a worker restarted against a status cell a dead worker left (SPEC.md STATUS-RESTART-RECOVERS):
the reference's first pass of the loop with its recovery taken out or done the plausible wrong way.

Each patches ``reference.restart.recover``, which the loop looks up at call time.
"""
from __future__ import annotations

from reference import restart as _restart
from reference.status import Status

from .base import Mutant

_real_recover = _restart.recover


class RestartNoRecovery(Mutant):
    id = "restart_no_recovery"
    bug = ("the loop acts on what the cell says as if it had asked for it (the reference before issue 19): a cell left "
           "UPDATING gets update() on loaded weights, which raises 'update() needs cleared weights, status is NORMAL', "
           "and the API refuses clear (403) and update (400) until the cell is rewritten by hand")
    kills = frozenset({"STATUS-RESTART-RECOVERS"})

    def patches(self):
        def recover(manager, cell, value, poll_s):
            manager.loop_started = True
            return None

        return {"reference.restart.recover": recover}


class RestartClearedMadeNormal(Mutant):
    id = "restart_cleared_made_normal"
    bug = ("a cell left CLEARED while the startup load holds weights is 'corrected' to NORMAL: the API's next update "
           "answers 'model weight is updated' and reloads nothing, serving the weights loaded before the trainer "
           "published the version it asked for")
    kills = frozenset({"STATUS-RESTART-RECOVERS"})

    def patches(self):
        def recover(manager, cell, value, poll_s):
            if not manager.loop_started and value == Status.CLEARED and manager.status == Status.NORMAL:
                manager.loop_started = True
                manager.cell.publish(Status.NORMAL, first_load=False)
                return "updated"
            return _real_recover(manager, cell, value, poll_s)

        return {"reference.restart.recover": recover}


class RestartClearedKeepsWeights(Mutant):
    id = "restart_cleared_keeps_weights"
    bug = ("a cell left CLEARED is left as it is and the startup load's weights are kept until the next update asks for "
           "a reload: the cell says the weights are released while they hold the memory a colocated trainer was told "
           "is free")
    kills = frozenset({"STATUS-RESTART-RECOVERS"})

    def patches(self):
        def recover(manager, cell, value, poll_s):
            if value == Status.CLEARED and manager.status == Status.NORMAL:
                manager.loop_started = True
                return "idle"
            if value == Status.UPDATING and manager.status == Status.NORMAL and manager.loop_started:
                manager.clear(publish=False)  # the reload the later update needs
                return None
            return _real_recover(manager, cell, value, poll_s)

        return {"reference.restart.recover": recover}


class RestartAnswersAnyUpdating(Mutant):
    id = "restart_answers_late_updating"
    bug = ("an UPDATING the first pass finds is always answered from the startup load, even one the API wrote while that "
           "load ran (the cell read CLEARED when it began): fine in the usual restart, stale when the trainer published "
           "in between")
    kills = frozenset({"STATUS-RESTART-RECOVERS"})

    def patches(self):
        def recover(manager, cell, value, poll_s):
            manager.cell_at_startup = Status.UPDATING
            return _real_recover(manager, cell, value, poll_s)

        return {"reference.restart.recover": recover}


class RestartRecoveryOverwritesRequest(Mutant):
    id = "restart_recovery_overwrites_request"
    bug = ("a cell left CLEARED is answered with an ordinary clear(), which writes CLEARED when it is done: an update the "
           "API asked for while the new worker released its startup load (after the loop read CLEARED) is overwritten, "
           "and the API waits for a NORMAL that never comes (or is told its update failed)")
    kills = frozenset({"STATUS-RESTART-RECOVERS"})

    def patches(self):
        def recover(manager, cell, value, poll_s):
            if not manager.loop_started and value == Status.CLEARED and manager.status == Status.NORMAL:
                manager.loop_started = True
                manager.clear()  # publishes CLEARED: the bug
                return "cleared"
            return _real_recover(manager, cell, value, poll_s)

        return {"reference.restart.recover": recover}


class RestartWritesBackWhatItRead(Mutant):
    id = "restart_writes_back_what_it_read"
    bug = ("the first pass 'confirms' the value it acted on by writing it back once its recovery is done (FastDeploy "
           "#5493's pattern, in the recovery): a request the API wrote during the pass is overwritten by the stale value")
    kills = frozenset({"STATUS-RESTART-RECOVERS"})

    def patches(self):
        def recover(manager, cell, value, poll_s):
            first = not manager.loop_started
            done = _real_recover(manager, cell, value, poll_s)
            if first and manager.cell.writes and value in (Status.CLEARED, Status.NORMAL):
                cell.write(value)
            return done

        return {"reference.restart.recover": recover}


class RestartFollowerNoWait(Mutant):
    id = "restart_follower_no_wait"
    bug = ("a restarted follower (tensor-parallel rank 1 of 2, which never writes the cell) that finds a dead worker's "
           "UPDATING answers it from its startup load (or reloads) and returns 'updated' at once, without waiting for "
           "rank 0's NORMAL: its next pass reads the request again and updates a second time for one request (into "
           "loaded weights: it fails and releases them, or reloads twice), and with rank 0 slow it ends unloaded "
           "(CLEARED) while rank 0 says NORMAL")
    kills = frozenset({"STATUS-RESTART-RECOVERS"})

    def patches(self):
        def recover(manager, cell, value, poll_s):  # reference.restart.recover without the follower's final wait
            if manager.loop_started:
                return None
            manager.loop_started = True
            if manager.status != Status.NORMAL or value not in (Status.UPDATING, Status.CLEARED):
                return None
            if value == Status.CLEARED:
                manager.clear(publish=False)
                return "cleared"
            if manager.cell_at_startup == Status.UPDATING:
                manager.cell.publish(Status.NORMAL, first_load=False)
            else:
                from reference.worker_loop import update

                if manager.load_strategy not in manager.IN_PLACE:
                    manager.clear(publish=False)
                update(manager, cell, poll_s)
            return "updated"  # the bug: a follower does not wait_while(cell, UPDATING, ...) for rank 0's NORMAL

        return {"reference.restart.recover": recover}


class RestartAnswersFromFailedStartup(Mutant):
    id = "restart_answers_from_failed_startup"
    bug = ("a dead worker's UPDATING, asked before the startup load, is answered NORMAL from that load without looking "
           "at whether it committed: when the startup load failed (the trainer's version lacked a parameter) the cell "
           "says NORMAL and the API's update is answered 200 over weights never loaded whole")
    kills = frozenset({"STATUS-RESTART-RECOVERS"})

    def patches(self):
        def recover(manager, cell, value, poll_s):
            if (not manager.loop_started and value == Status.UPDATING and manager.status != Status.NORMAL
                    and manager.cell_at_startup == Status.UPDATING):
                manager.loop_started = True
                manager.cell.publish(Status.NORMAL, first_load=False)
                return "updated"
            return _real_recover(manager, cell, value, poll_s)

        return {"reference.restart.recover": recover}


class RestartFailedStartupSilent(Mutant):
    id = "restart_failed_startup_silent"
    bug = ("a worker whose startup load failed leaves a dead worker's UPDATING to its loop as usual: the loop loads the "
           "trainer's newer version, but as a retry of the startup load, which writes no status "
           "(STATUS-FIRST-LOAD-SILENT): the cell stays UPDATING and the API's update waits out its timeout")
    kills = frozenset({"STATUS-RESTART-RECOVERS"})

    def patches(self):
        def recover(manager, cell, value, poll_s):
            if not manager.loop_started and manager.status != Status.NORMAL:
                manager.loop_started = True
                return None
            return _real_recover(manager, cell, value, poll_s)

        return {"reference.restart.recover": recover}
