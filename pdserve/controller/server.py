"""The controller process's gRPC face: `pdserve.v1.Controller` for operators, health,
reflection, and Prometheus metrics.

Owns mapping operator calls onto `service.Controller` and its answers and errors onto gRPC
(unknown worker NOT_FOUND, a bad split INVALID_ARGUMENT naming the field, a worker already
switching ABORTED), and its listener: TLS whose `Guard` admits an operator's certificate or
an admin key (`authorization: Bearer <admin key>`); a tenant's API key or a component's
certificate is PERMISSION_DENIED, nothing UNAUTHENTICATED; each action's audit line names who.
Must not decide anything.
"""

from __future__ import annotations

import sys

import grpc

from pdserve import rpc
from pdserve.controller.config import ControllerConfig
from pdserve.controller.connector import LiveConnector
from pdserve.controller.routers import Routers
from pdserve.controller.flip import FlipBusy, FlipOutcome
from pdserve.controller.service import Controller, UnknownWorker
from pdserve.proto import controller_pb2 as pb
from pdserve.proto import controller_pb2_grpc as pb_grpc
from pdserve.core.identity import CONTROLLER
from pdserve.security.tenants import ApiKeys
from pdserve.security.keys import AdminKeys
from pdserve.wire import PROTO_OF_ROLE, role_from_proto

MODE_OF = {"active": pb.CONTROLLER_MODE_ACTIVE, "advisory": pb.CONTROLLER_MODE_ADVISORY,
           "off": pb.CONTROLLER_MODE_OFF}
MODE_NAMES = {v: k for k, v in MODE_OF.items()}


def _outcome(o: FlipOutcome) -> pb.FlipResult:
    return pb.FlipResult(address=o.address, from_role=PROTO_OF_ROLE.get(o.from_role, 0),
                         to_role=PROTO_OF_ROLE.get(o.to_role, 0), ok=o.ok, seconds=o.seconds,
                         error=o.error, drained_requests=o.drained_requests)


class ControllerServicer(pb_grpc.ControllerServicer):
    """Operator calls onto the controller. Who may call is the listener's Guard's business
    (`pdserve.security`): by the time a method runs the caller is an operator, by admin key or
    certificate, and `rpc.caller()` names it for the audit log."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    def _call(self, context, fn):
        try:
            return fn()
        except UnknownWorker as e:
            context.abort(grpc.StatusCode.NOT_FOUND, e.args[0])
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except FlipBusy as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
        except grpc.RpcError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"router: {e.code().name}: {e.details()}")

    def _role(self, role: int, context) -> str:
        name = role_from_proto(role)
        if name is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "role: must be ROLE_PREFILL or ROLE_DECODE")
        return name

    def Status(self, request, context):
        return self._call(context, lambda: self._status())

    def _status(self) -> pb.ControllerStatus:
        c = self.c
        view = c.observe()
        with c._lock:
            snap, target, now = c.snapshot, c.target, c.clock()
            flips = dict(c.flips)
            pinned = set(c.pinned)
            mode, flips_total, ticks = c.mode, c.flips_total, c.ticks
        budgets = {m.address: m for m in view.members}
        out = pb.ControllerStatus(
            mode=MODE_OF[mode], prefill_pressure=view.prefill.ratio,
            decode_pressure=view.decode.ratio, prefill_work_s=view.prefill.work_s,
            window_s=c.cfg.window_s, window_requests=view.window.requests,
            slo_attainment=-1 if view.window.attainment is None else view.window.attainment,
            ttft_p90_s=view.window.ttft_p90_s or 0.0, itl_p90_s=view.window.itl_p90_s or 0.0,
            ttft_slo_s=c.slo.ttft_s, itl_slo_s=c.slo.itl_s, has_target=target is not None,
            target_prefill=target[0] if target else 0, target_decode=target[1] if target else 0,
            conflicts=snap.conflicts, flips_total=flips_total, ticks=ticks,
            last_action=snap.decision.action if snap.decision else "",
            last_reason=snap.decision.reason if snap.decision else "")
        for w in view.workers:
            m = budgets[w.address]
            f = flips.get(w.address)
            stats = m.stats if m.HasField("stats") else None
            out.workers.append(pb.ControlledWorker(
                address=w.address, role=PROTO_OF_ROLE.get(w.role, 0),
                state="serving" if w.state == "serving" else w.state,
                pinned=w.address in pinned, running=w.running, waiting=w.waiting,
                kv_used_blocks=w.kv_used_blocks, kv_total_blocks=w.kv_total_blocks,
                last_flip_age_s=now - f.at_s if f else -1.0,
                last_flip_reason=f.reason if f else "",
                role_switches=stats.role_switches if stats else 0,
                offload_budget_tokens=m.offload_budget_tokens,
                offload_in_flight_tokens=m.offload_in_flight_tokens, in_flight=m.in_flight))
        return out

    def SetRole(self, request, context):
        role = self._role(request.role, context)
        return self._call(context, lambda: _outcome(
            self.c.set_role(request.address, role, request.drain_timeout_s, rpc.caller())))

    def Rebalance(self, request, context):
        def run():
            plan, results = self.c.rebalance(request.prefill, request.decode, request.dry_run,
                                             request.drain_timeout_s, rpc.caller())
            return pb.RebalanceResponse(
                plan=[pb.PlannedFlip(address=f.address, from_role=PROTO_OF_ROLE[f.from_role],
                                     to_role=PROTO_OF_ROLE[f.to_role]) for f in plan],
                results=[_outcome(o) for o in results])
        return self._call(context, run)

    def Release(self, request, context):
        return self._call(context, lambda: pb.ReleaseResponse(had_target=self.c.release(rpc.caller())))

    def Pin(self, request, context):
        def run():
            self.c.pin(request.address, True, rpc.caller())
            return pb.PinWorkerResponse(address=request.address, pinned=True)
        return self._call(context, run)

    def Unpin(self, request, context):
        def run():
            self.c.pin(request.address, False, rpc.caller())
            return pb.PinWorkerResponse(address=request.address, pinned=False)
        return self._call(context, run)

    def SetMode(self, request, context):
        if request.mode not in MODE_NAMES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "mode: must be active, advisory or off")
        return self._call(context, lambda: pb.SetModeResponse(
            previous=MODE_OF[self.c.set_mode(MODE_NAMES[request.mode], rpc.caller())], mode=request.mode))


def run(cfg: ControllerConfig, health_address: str | None = None) -> int:
    """Serve until SIGTERM/SIGINT; an exit code."""
    rpc.catch_stop_signals()
    try:
        admin = AdminKeys.load(cfg.admin_keys_file)
        tenants = ApiKeys.load(cfg.api_keys_file)
    except (ValueError, OSError) as e:  # KeyFileError names the line
        print(f"pdserve.controller: {e}", file=sys.stderr, flush=True)
        return 2
    controller = Controller(cfg, LiveConnector(Routers(cfg.router_address, cfg.store_address)))
    server = rpc.make_server(cfg.rpc_threads, maximum_concurrent_rpcs=64)
    guard = rpc.Guard(CONTROLLER, rpc.CONTROL, admin, is_tenant_key=tenants.holds)
    rpc.add_servicer(server, pb_grpc.add_ControllerServicer_to_server,
                     ControllerServicer(controller), guard)
    health = rpc.add_health_and_reflection(server, ["pdserve.v1.Controller"])
    note, metrics_server = "", None
    if cfg.metrics_port >= 0:
        from prometheus_client import start_http_server

        host = cfg.address.rpartition(":")[0].strip("[]")
        metrics_server, thread = start_http_server(cfg.metrics_port, addr=host,
                                                   registry=controller.metrics.registry)
        note = f" metrics=http://{host}:{metrics_server.server_port}/metrics"
    controller.start()
    code = rpc.run_until_signal(
        server, health, cfg.address,
        lambda where: f"pdserve.controller ready on {where} mode={cfg.mode} "
                      f"router={cfg.router_address or 'every router'}{note}", CONTROLLER, plane=rpc.CONTROL,
        health_address=health_address)
    controller.stop()
    if metrics_server is not None:
        metrics_server.shutdown()
    return code
