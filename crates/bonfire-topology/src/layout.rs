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

#[cfg(test)]
mod tests {
    use super::*;

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
