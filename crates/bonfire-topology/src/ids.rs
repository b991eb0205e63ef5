use std::fmt;

/// A process's index in a group of processes, counted from 0.
///
/// A `Rank` names a process in the *world* (all processes of the job) unless a function says it
/// is an index inside a smaller group.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rank(pub u32);

impl Rank {
    /// The rank as a `usize` index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl From<usize> for Rank {
    fn from(value: usize) -> Self {
        Rank(u32::try_from(value).expect("rank does not fit in u32"))
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

/// Identifies a communication group. Every member computes the same id without talking
/// (see [`stable_hash`]), and frames carry it so that groups sharing a transport never mix.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(pub u64);

impl GroupId {
    /// The group of all ranks of a job.
    pub const WORLD: GroupId = GroupId(0x626f_6e66_6972_6531); // "bonfire1"

    /// The id of a group derived from this one; `parts` must be the same on every member.
    pub fn derive(self, parts: &[u64]) -> GroupId {
        let mut words = Vec::with_capacity(parts.len() + 1);
        words.push(self.0);
        words.extend_from_slice(parts);
        GroupId(stable_hash(&words))
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == GroupId::WORLD {
            f.write_str("world")
        } else {
            write!(f, "group {:016x}", self.0)
        }
    }
}

/// Identifies a machine (a node) of the job.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}", self.0)
    }
}

/// A hash that is the same in every process, run and platform (splitmix64 over the words).
///
/// `std`'s hashers are randomly seeded per process, so they cannot name things that several
/// processes must agree on.
pub fn stable_hash(words: &[u64]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15 ^ (words.len() as u64);
    for &w in words {
        h = mix(h ^ mix(w));
    }
    h
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_hash_is_pinned() {
        // Pinned so that a change of the function, which would split a job whose processes run
        // different builds, is noticed.
        assert_eq!(stable_hash(&[]), 0x9e37_79b9_7f4a_7c15);
        assert_ne!(stable_hash(&[1, 2]), stable_hash(&[2, 1]));
        assert_eq!(stable_hash(&[7, 9]), stable_hash(&[7, 9]));
    }

    #[test]
    fn derived_groups_differ() {
        let a = GroupId::WORLD.derive(&[1, 0]);
        let b = GroupId::WORLD.derive(&[1, 1]);
        assert_ne!(a, b);
        assert_ne!(a, GroupId::WORLD);
        assert_eq!(a, GroupId::WORLD.derive(&[1, 0]));
        assert_eq!(GroupId::WORLD.to_string(), "world");
        assert_eq!(Rank(3).to_string(), "rank 3");
    }
}
