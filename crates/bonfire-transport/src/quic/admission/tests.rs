//! The rendezvous' decisions, table by table, without a network.

use super::*;

const EXPORTER: &[u8] = b"this session's keying material";

fn secret() -> Secret {
    Secret::new(b"0123456789abcdef-admission").unwrap()
}

fn job(world_size: u32) -> JobKey {
    JobKey {
        world_size,
        round: 2,
    }
}

/// A hello for `job`, with a proof from `secret` bound to `EXPORTER`.
fn claim(job: JobKey, secret: &Secret) -> Claim {
    Claim {
        protocol: PROTOCOL,
        job,
        proof: secret.proof(ROLE_CLIENT, EXPORTER),
    }
}

fn entry(rank: u32, node: u32) -> PeerEntry {
    PeerEntry {
        rank,
        node,
        addr: SocketAddr::from(([10, 0, 0, rank as u8], 29500)),
        cert: vec![rank as u8],
    }
}

#[test]
fn hellos_are_checked_in_order_and_refusals_name_the_claimant() {
    let s = secret();
    let other = Secret::new(b"0123456789abcdef-another-job").unwrap();
    let ours = job(4);
    let good = claim(ours, &s);
    let with = |f: fn(&mut Claim)| {
        let mut c = good;
        f(&mut c);
        c
    };
    // (what, rank claimed, hello, outcome, words the refusal must contain)
    type Case = (
        &'static str,
        Option<u32>,
        Claim,
        Result<(), Refusal>,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        ("a worker with its rank", Some(3), good, Ok(()), ""),
        ("a worker asking for one", None, good, Ok(()), ""),
        (
            "another protocol",
            Some(1),
            with(|c| c.protocol += 1),
            Err(Refusal::Protocol {
                theirs: PROTOCOL + 1,
            }),
            "run the same bonfire version on every rank",
        ),
        (
            "another world size",
            Some(1),
            with(|c| c.job.world_size = 8),
            Err(Refusal::WorldSize {
                claimant: Claimant(Some(1)),
                theirs: 8,
                ours: 4,
            }),
            "world size mismatch: the process claiming rank 1 expects 8 ranks, this job has 4",
        ),
        (
            "another round",
            None,
            with(|c| c.job.round = 1),
            Err(Refusal::Round {
                claimant: Claimant(None),
                theirs: 1,
                ours: 2,
            }),
            "restart round mismatch: a process asking for a rank is in round 1, this job is in round 2",
        ),
        (
            "rank 0 is not a worker",
            Some(0),
            good,
            Err(Refusal::NotAWorker { rank: 0, world: 4 }),
            "rank 0 is not a worker rank of a job of 4 ranks",
        ),
        (
            "a rank past the job",
            Some(4),
            good,
            Err(Refusal::NotAWorker { rank: 4, world: 4 }),
            "rank 4 is not a worker rank",
        ),
        (
            "another job's secret",
            Some(2),
            claim(ours, &other),
            Err(Refusal::WrongSecret {
                claimant: Claimant(Some(2)),
            }),
            "wrong job secret: the process claiming rank 2 does not hold the secret of this job",
        ),
        (
            "a proof from another session",
            Some(2),
            with(|c| c.proof[0] ^= 1),
            Err(Refusal::WrongSecret {
                claimant: Claimant(Some(2)),
            }),
            "wrong job secret",
        ),
        // The protocol is checked first: a stranger learns nothing else.
        (
            "everything wrong",
            Some(9),
            Claim {
                protocol: 0,
                job: job(7),
                proof: [0; PROOF_LEN],
            },
            Err(Refusal::Protocol { theirs: 0 }),
            "protocol version 0",
        ),
    ];
    for (what, rank, claim, want, text) in cases {
        let got = check_hello(ours, rank, &claim, &s, EXPORTER);
        assert_eq!(got, want, "{what}");
        if let Err(refusal) = got {
            assert!(refusal.to_string().contains(text), "{what}: {refusal}");
        }
    }
}

#[test]
fn rank_zero_reserves_asked_ranks_and_assigns_the_lowest_free_one() {
    let s = secret();
    let c = claim(job(4), &s);
    let mut table = Admission::new(job(4));
    // (rank asked for, outcome), in arrival order.
    let arrivals: [(Option<u32>, Result<u32, Refusal>); 6] = [
        (Some(2), Ok(2)),
        (None, Ok(1)),
        (Some(2), Err(Refusal::Taken { rank: 2 })),
        (None, Ok(3)),
        (None, Err(Refusal::Full { world: 4 })),
        (Some(1), Err(Refusal::Taken { rank: 1 })),
    ];
    for (i, (asked, want)) in arrivals.into_iter().enumerate() {
        assert_eq!(table.admit(asked, &c, &s, EXPORTER), want, "arrival {i}");
    }
    // A welcome that could not be sent frees its rank for the next one to ask.
    table.release(1);
    assert_eq!(table.admit(None, &c, &s, EXPORTER), Ok(1));
    assert_eq!(
        table.admit(None, &c, &s, EXPORTER),
        Err(Refusal::Full { world: 4 })
    );
    assert_eq!(
        Refusal::Full { world: 4 }.to_string(),
        "the job is full: all 4 ranks have joined"
    );
    assert_eq!(
        Refusal::Taken { rank: 2 }.to_string(),
        "rank 2 has already joined this job"
    );
}

#[test]
fn refused_hellos_reserve_nothing_and_a_closed_rendezvous_admits_nobody() {
    let s = secret();
    let good = claim(job(3), &s);
    let stranger = claim(job(3), &Secret::new(b"0123456789abcdef-stranger").unwrap());
    let mut table = Admission::new(job(3));
    assert!(matches!(
        table.admit(Some(1), &stranger, &s, EXPORTER),
        Err(Refusal::WrongSecret { .. })
    ));
    assert!(matches!(
        table.admit(None, &stranger, &s, EXPORTER),
        Err(Refusal::WrongSecret { .. })
    ));
    assert_eq!(table.admit(None, &good, &s, EXPORTER), Ok(1));
    table.close();
    assert_eq!(
        table.admit(Some(2), &good, &s, EXPORTER),
        Err(Refusal::Started)
    );
    // A stranger still hears what is wrong with it, not that the job started.
    assert!(matches!(
        table.admit(Some(2), &stranger, &s, EXPORTER),
        Err(Refusal::WrongSecret { .. })
    ));
    // A job of one rank has no worker rank to give.
    let mut alone = Admission::new(job(1));
    assert_eq!(
        alone.admit(None, &claim(job(1), &s), &s, EXPORTER),
        Err(Refusal::Full { world: 1 })
    );
}

#[test]
fn only_the_higher_rank_may_dial() {
    let s = secret();
    let c = claim(job(5), &s);
    // (me, the rank dialling in, outcome)
    let cases: [(u32, u32, Result<u32, Refusal>); 5] = [
        (1, 2, Ok(2)),
        (2, 4, Ok(4)),
        (
            3,
            2,
            Err(Refusal::WrongDirection {
                rank: 2,
                me: Rank(3),
            }),
        ),
        (
            3,
            3,
            Err(Refusal::WrongDirection {
                rank: 3,
                me: Rank(3),
            }),
        ),
        (2, 5, Err(Refusal::NotAWorker { rank: 5, world: 5 })),
    ];
    for (me, rank, want) in cases {
        let got = admit_peer(job(5), Rank(me), rank, &c, &s, EXPORTER);
        assert_eq!(got, want, "rank {rank} dialling rank {me}");
    }
    assert_eq!(
        Refusal::WrongDirection {
            rank: 2,
            me: Rank(3)
        }
        .to_string(),
        "rank 2 should be dialled by rank 3, not dial it"
    );
}

#[test]
fn a_worker_takes_only_a_worker_rank_it_asked_for() {
    // (asked, assigned, world, accepted)
    let cases: [(Option<u32>, u32, usize, Option<u32>); 7] = [
        (None, 1, 2, Some(1)),
        (None, 3, 4, Some(3)),
        (Some(2), 2, 4, Some(2)),
        (Some(2), 3, 4, None),
        (None, 0, 4, None),
        (None, 4, 4, None),
        (Some(0), 0, 4, None),
    ];
    for (asked, assigned, world, want) in cases {
        assert_eq!(
            assigned_rank(asked.map(Rank), assigned, world),
            want.map(Rank),
            "asked {asked:?}, assigned {assigned}, world {world}"
        );
    }
}

#[test]
fn every_pair_of_ranks_links_exactly_once() {
    for world in 1..=9usize {
        for a in 0..world {
            for b in a + 1..world {
                // Rank 0 links to every worker through the rendezvous; any other pair
                // links directly, the higher rank dialling.
                let dials = lower_workers(Rank(b as u32)).contains(&a);
                let awaits = higher_ranks(Rank(a as u32), world).contains(&b);
                let backwards = lower_workers(Rank(a as u32)).contains(&b)
                    || higher_ranks(Rank(b as u32), world).contains(&a);
                assert!(!backwards, "world {world}: {a} and {b} link the wrong way");
                if a == 0 {
                    assert!(!dials && !awaits, "world {world}: 0 and {b} link twice");
                    assert!(missing_workers(&vec![None::<()>; world]).contains(&b));
                } else {
                    assert!(dials && awaits, "world {world}: {a} and {b} never link");
                }
            }
        }
    }
    assert_eq!(lower_workers(Rank(0)), 1..1);
    assert_eq!(lower_workers(Rank(3)), 1..3);
    assert_eq!(higher_ranks(Rank(3), 4), 4..4);
    assert!(higher_ranks(Rank(0), 4).is_empty());
    assert_eq!(higher_ranks(Rank(1), 4), 2..4);
}

#[test]
fn missing_ranks_are_listed_in_order() {
    let joined = [None, Some(()), None, Some(()), None];
    assert_eq!(missing_workers(&joined), vec![2, 4]);
    assert_eq!(missing_workers(&[None::<()>]), Vec::<usize>::new());
    assert_eq!(
        missing_workers(&[None, Some(()), Some(())]),
        Vec::<usize>::new()
    );
    // Rank 2 waits only for the ranks above it.
    let accepted = [None, None, None, Some(()), None];
    assert_eq!(missing_links(Rank(2), &accepted), vec![4]);
    assert_eq!(missing_links(Rank(4), &accepted), Vec::<usize>::new());
    assert_eq!(list([]), "none");
    assert_eq!(list([1]), "ranks 1");
    assert_eq!(list([2, 4]), "ranks 2, 4");
    assert_eq!(
        Refusal::TimedOut {
            missing: vec![2, 4],
            world: 5
        }
        .to_string(),
        "the rendezvous timed out waiting for 2 of 5 ranks (ranks 2, 4)"
    );
}

#[test]
fn the_roster_lists_every_rank_in_order_and_gives_the_layout() {
    let peers = roster(entry(0, 0), [entry(3, 1), entry(1, 0), entry(2, 1)]);
    let ranks: Vec<u32> = peers.iter().map(|p| p.rank).collect();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
    assert_eq!(check_roster(&peers, 4), Ok(()));
    let nodes = layout(&peers);
    let of: Vec<NodeId> = (0..4).map(|r| nodes.node_of(Rank(r))).collect();
    assert_eq!(of, vec![NodeId(0), NodeId(0), NodeId(1), NodeId(1)]);

    let malformed: [(Vec<PeerEntry>, usize); 4] = [
        (peers[..3].to_vec(), 3 + 1),
        (vec![entry(0, 0), entry(2, 0), entry(1, 0)], 3),
        (vec![entry(0, 0), entry(1, 0), entry(1, 0)], 3),
        (vec![entry(1, 0), entry(0, 0)], 2),
    ];
    for (peers, world) in malformed {
        let got = check_roster(&peers, world);
        assert_eq!(
            got,
            Err(MalformedRoster {
                entries: peers.len(),
                world
            }),
            "{:?}",
            peers.iter().map(|p| p.rank).collect::<Vec<_>>()
        );
    }
    assert_eq!(
        MalformedRoster {
            entries: 3,
            world: 4
        }
        .to_string(),
        "malformed roster: 3 entries for 4 ranks"
    );
}

#[test]
fn a_worker_is_reached_where_it_says_or_where_it_was_seen() {
    let seen: SocketAddr = "192.168.1.7:40000".parse().unwrap();
    let relay: SocketAddr = "10.9.8.7:7000".parse().unwrap();
    assert_eq!(
        reach_addr(seen, 29511, None),
        "192.168.1.7:29511".parse().unwrap()
    );
    assert_eq!(reach_addr(seen, 29511, Some(relay)), relay);
}
