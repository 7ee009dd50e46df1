"""Inter-op pieces the stage planner shares: sub-mesh shapes, the cross-mesh send, stage placement.

Stage costs come from the intra-op pass (``passes/stage_costs.py``); the stage
DP is ``passes/stages.py``. Here:

- :func:`submesh_candidates`: every width inside a node and whole nodes;
- :func:`cross_mesh_send_s`: one activation from one sub-mesh to another over
  the link the two cross (split destination: every device pair moves its share
  in parallel; replicated destination: the cheaper of sending the whole tensor
  to every device and sending it once, split, then all-gathering inside the
  destination mesh);
- :func:`place_stages`: device indices per stage, first fit in stage order.
"""
from __future__ import annotations



from autoshard.meshes.cluster import ClusterSpec
from autoshard.meshes.cost import point_to_point_s, ring_all_gather_s
from autoshard.passes.stages import StagePlan, SubmeshShape


def submesh_candidates(cluster: ClusterSpec, num_devices: int) -> tuple[SubmeshShape, ...]:
    per_node = min(cluster.devices_per_node, num_devices)
    shapes = [(1, d) for d in range(1, per_node + 1)]
    shapes += [(m, cluster.devices_per_node) for m in range(2, num_devices // cluster.devices_per_node + 1)]
    return tuple(shapes)


def cross_mesh_send_s(cluster: ClusterSpec, nbytes: float, src_devices: int, dst_devices: int, *,
                      cross_node: bool, dst_replicated: bool) -> float:
    """Move an activation of ``nbytes`` from one sub-mesh to another (one direction).

    Split destination: every device pair moves its share in parallel, bytes / min(n_src, n_dst) per link.
    Replicated destination: the cheaper of every destination device receiving the whole tensor over the
    crossing link, and sending it once, split over the destination devices, then all-gathering inside the
    destination mesh (over its fast intra-node link when the destination is one node).
    """
    if nbytes <= 0:
        return 0.0
    link = cluster.inter_node if cross_node else cluster.intra_node
    once = point_to_point_s(nbytes / max(1, min(src_devices, dst_devices)), link)
    if not dst_replicated or dst_devices == 1:
        return once
    direct = point_to_point_s(nbytes, link)
    gather_link = cluster.intra_node if dst_devices <= cluster.devices_per_node else cluster.inter_node
    return min(direct, once + ring_all_gather_s(nbytes, dst_devices, gather_link))


def place_stages(plan: StagePlan, cluster: ClusterSpec, num_devices: int) -> list[tuple[int, ...]]:
    """Device indices per stage: first fit in stage order; a (1, d) stage stays inside one node. An interleaved
    plan places its first p stages (one per device group) so, and stage s shares group s mod p's devices."""
    per_node = min(cluster.devices_per_node, num_devices)
    num_nodes = max(1, num_devices // per_node)
    free = [list(range(node * per_node, (node + 1) * per_node)) for node in range(num_nodes)]
    placed: list[tuple[int, ...]] = []
    groups = len(plan.stages) // plan.chunks
    for stage in plan.stages[:groups]:
        nodes, per = stage.submesh
        if nodes == 1:
            node = next((i for i, f in enumerate(free) if len(f) >= per), None)
            if node is None:
                raise ValueError(f"cannot place stage {stage} on one node: free devices {free}")
            placed.append(tuple(free[node][:per]))
            free[node] = free[node][per:]
        else:
            whole = [i for i, f in enumerate(free) if len(f) == per_node][:nodes]
            if len(whole) < nodes:
                raise ValueError(f"cannot place stage {stage}: needs {nodes} free nodes, free devices {free}")
            placed.append(tuple(d for i in whole for d in free[i]))
            for i in whole:
                free[i] = []
    return [placed[s % groups] for s in range(len(plan.stages))]
