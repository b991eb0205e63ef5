//! Hierarchical all-reduce: reduce within each node, all-reduce across nodes among one leader per
//! node, broadcast within each node. Only one rank per node crosses the network.

use bonfire_topology::NodeId;

use super::{Builder, Team, broadcast_binomial, reduce_binomial};

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
    let me = team.me();
    let my_node = nodes[me];
    let local: Vec<usize> = (0..team.size()).filter(|&p| nodes[p] == my_node).collect();
    let local_me = local
        .iter()
        .position(|&p| p == me)
        .expect("a rank is on its own node");
    let local_team = Team::new(local.iter().map(|&p| team.peer(p)).collect(), local_me);

    let mut leaders: Vec<usize> = Vec::new();
    for p in 0..team.size() {
        if !leaders.iter().any(|&l| nodes[l] == nodes[p]) {
            leaders.push(p);
        }
    }

    reduce_binomial(b, &local_team, 0, 0..count, 0, false);
    if local_me == 0 {
        let leader_me = leaders
            .iter()
            .position(|&l| l == me)
            .expect("a node's first rank leads it");
        let leader_team = Team::new(leaders.iter().map(|&p| team.peer(p)).collect(), leader_me);
        inner(b, &leader_team, count, 1, false);
        if finalize {
            b.finalize(0..count);
        }
    }
    broadcast_binomial(b, &local_team, 0, 0..count, 5);
}
