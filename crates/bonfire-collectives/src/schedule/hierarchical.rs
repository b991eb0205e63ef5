//! Hierarchical all-reduce. Where every node holds the same number of ranks (as `bonfire launch`
//! places them), two levels: reduce-scatter within each node, all-reduce of each segment across
//! nodes among the ranks holding it (one per node), all-gather within each node; every rank
//! crosses the network with `1/local` of the buffer, and every one of a node's ranks does. Other
//! layouts reduce to one leader per node, all-reduce among the leaders, and broadcast within each
//! node.

use bonfire_topology::{ByNode, NodeId, Partition};

use super::{
    Builder, Team, all_gather_ring, broadcast_binomial, reduce_binomial, reduce_scatter_ring,
};

/// The ranks of one node (`group`, team positions), as a team in which this rank is position `i`.
fn node_team(team: &Team, group: &[usize], i: usize) -> Team {
    Team::new(group.iter().map(|&p| team.peer(p)).collect(), i)
}

/// Two-level all-reduce over `team` (see the module): phase 0 reduce-scatters within the node,
/// `inner` runs on this rank's segment among the ranks holding it on every node (phases
/// `1..=4`), phase 5 all-gathers within the node. Returns `false`, adding nothing, if the nodes
/// do not all hold the same number of ranks.
pub(crate) fn all_reduce_two_level(
    b: &mut Builder,
    team: &Team,
    nodes: &[NodeId],
    count: usize,
    inner: FlatAllReduce,
    finalize: bool,
) -> bool {
    assert_eq!(nodes.len(), team.size());
    let by = ByNode::of(nodes);
    let Ok(local) = by.per_node() else {
        return false;
    };
    let groups = by.groups();
    let (k, i) = by.locate(team.me());
    let local_team = node_team(team, &groups[k], i);
    let rail = Team::new(groups.iter().map(|g| team.peer(g[i])).collect(), k);
    let parts = Partition::balanced(count, local);
    reduce_scatter_ring(b, &local_team, &parts, 0);
    let segment = parts.segment(i);
    let mut sub = b.sub();
    inner(&mut sub, &rail, segment.len(), 1, finalize);
    b.append_shifted(sub, segment.start);
    all_gather_ring(b, &local_team, &parts, 5);
    true
}

/// A flat all-reduce builder: `(builder, team, count, first phase, finalize)`.
pub(crate) type FlatAllReduce = fn(&mut Builder, &Team, usize, u8, bool);

/// Hierarchical all-reduce over `team`, where `nodes[i]` is the node of team position `i`. The
/// leader of a node is its first position. `inner` runs among the leaders. Phases `0..=5`.
pub(crate) fn all_reduce_hierarchical(
    b: &mut Builder,
    team: &Team,
    nodes: &[NodeId],
    count: usize,
    inner: FlatAllReduce,
    finalize: bool,
) {
    assert_eq!(nodes.len(), team.size());
    let by = ByNode::of(nodes);
    let groups = by.groups();
    let (k, i) = by.locate(team.me());
    let local_team = node_team(team, &groups[k], i);

    reduce_binomial(b, &local_team, 0, 0..count, 0, false);
    if i == 0 {
        // The leaders, one per node in node order: this rank is leader `k`.
        let leader_team = Team::new(groups.iter().map(|g| team.peer(g[0])).collect(), k);
        inner(b, &leader_team, count, 1, false);
        if finalize {
            b.finalize(0..count);
        }
    }
    broadcast_binomial(b, &local_team, 0, 0..count, 5);
}
