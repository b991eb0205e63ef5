use crate::{NodeId, Rank};

/// Which node (machine) each rank of the world runs on.
///
/// Hierarchical collectives use it to reduce within a node before crossing the network. Every
/// rank must hold the same layout.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NodeLayout {
    node_of: Vec<NodeId>,
}

impl NodeLayout {
    /// All `world` ranks on one node.
    pub fn single_node(world: usize) -> NodeLayout {
        NodeLayout {
            node_of: vec![NodeId(0); world],
        }
    }

    /// `world` ranks placed `per_node` at a time on consecutive nodes (the last node may hold
    /// fewer), as `bonfire launch --nproc-per-node` places them.
    ///
    /// # Panics
    /// If `per_node` is zero.
    pub fn uniform(world: usize, per_node: usize) -> NodeLayout {
        assert!(per_node > 0, "a node holds at least one rank");
        NodeLayout {
            node_of: (0..world).map(|r| NodeId((r / per_node) as u32)).collect(),
        }
    }

    /// A layout from each rank's node, in rank order.
    pub fn from_nodes(node_of: Vec<NodeId>) -> NodeLayout {
        NodeLayout { node_of }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.node_of.len()
    }

    /// The node of `rank`.
    pub fn node_of(&self, rank: Rank) -> NodeId {
        self.node_of[rank.index()]
    }

    /// Number of distinct nodes.
    pub fn node_count(&self) -> usize {
        let mut nodes: Vec<NodeId> = self.node_of.clone();
        nodes.sort_unstable();
        nodes.dedup();
        nodes.len()
    }
}

/// A group's members by node: each node's member positions in order, the nodes in order of
/// their first member. The one rule for which ranks share a node and where each sits among them
/// (the hierarchical schedule and the device lane across nodes both follow it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ByNode {
    nodes: Vec<NodeId>,
    groups: Vec<Vec<usize>>,
}

impl ByNode {
    /// Groups positions `0..nodes.len()`, where `nodes[p]` is the node of position `p`.
    pub fn of(nodes: &[NodeId]) -> ByNode {
        let mut by = ByNode {
            nodes: Vec::new(),
            groups: Vec::new(),
        };
        for (p, node) in nodes.iter().enumerate() {
            match by.nodes.iter().position(|n| n == node) {
                Some(k) => by.groups[k].push(p),
                None => {
                    by.nodes.push(*node);
                    by.groups.push(vec![p]);
                }
            }
        }
        by
    }

    /// Each node's positions, nodes in order of their first position.
    pub fn groups(&self) -> &[Vec<usize>] {
        &self.groups
    }

    /// The node of group `k`.
    pub fn node(&self, k: usize) -> NodeId {
        self.nodes[k]
    }

    /// Which group holds position `p`, and `p`'s index in it.
    ///
    /// # Panics
    /// If `p` is not a position of the grouping.
    pub fn locate(&self, p: usize) -> (usize, usize) {
        self.groups
            .iter()
            .enumerate()
            .find_map(|(k, g)| g.iter().position(|&q| q == p).map(|i| (k, i)))
            .expect("a position of the grouping")
    }

    /// The number of positions per node when every node holds as many, else the first node
    /// whose count differs from the first node's, with both counts: `Err((first, node, count))`.
    pub fn per_node(&self) -> Result<usize, (usize, usize, usize)> {
        let first = self.groups.first().map_or(0, Vec::len);
        match self.groups.iter().position(|g| g.len() != first) {
            None => Ok(first),
            Some(k) => Err((first, k, self.groups[k].len())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_group_by_node_in_order_of_first_appearance() {
        let by = ByNode::of(&[NodeId(7), NodeId(3), NodeId(7), NodeId(3)]);
        assert_eq!(by.groups(), &[vec![0, 2], vec![1, 3]]);
        assert_eq!((by.node(0), by.node(1)), (NodeId(7), NodeId(3)));
        assert_eq!(by.locate(2), (0, 1));
        assert_eq!(by.locate(1), (1, 0));
        assert_eq!(by.per_node(), Ok(2));
        let uneven = ByNode::of(&[NodeId(0), NodeId(0), NodeId(1), NodeId(2), NodeId(2)]);
        assert_eq!(uneven.per_node(), Err((2, 1, 1)));
        assert_eq!(ByNode::of(&[]).per_node(), Ok(0));
    }

    #[test]
    fn uniform_fills_nodes_in_order() {
        let l = NodeLayout::uniform(5, 2);
        assert_eq!(l.node_of(Rank(0)), NodeId(0));
        assert_eq!(l.node_of(Rank(3)), NodeId(1));
        assert_eq!(l.node_of(Rank(4)), NodeId(2));
        assert_eq!(l.node_count(), 3);
        assert_eq!(NodeLayout::single_node(4).node_count(), 1);
    }
}
