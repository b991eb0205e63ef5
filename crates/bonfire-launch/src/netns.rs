//! Network namespaces that play separate hosts on this one (root and the `ip` tool needed; each
//! constructor returns `None` where the machine does not allow them, and the caller skips).
//!
//! - [`Namespaces::star`]: two namespaces, each joined to this one by its own veth pair
//!   (10.71.0.0/24 and 10.72.0.0/24; this side `.1`, the namespace `.2`): traffic between them
//!   goes through a program here, such as a delaying relay ([`crate::wan`]).
//!   [`Namespaces::star_at`] picks the two subnets.
//! - [`Namespaces::pair`]: two namespaces joined to each other by one veth pair (10.73.0.1 and
//!   10.73.0.2), as two hosts on one link.
//!
//! Dropping the value deletes the namespaces (and with them their veth ends).

use std::process::Command;

/// Two network namespaces; see the module's docs.
pub struct Namespaces {
    /// Their names, for `ip netns exec NAME ...`.
    pub names: [String; 2],
    /// The address of each on the link(s) that join it.
    pub addrs: [String; 2],
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
}

impl Namespaces {
    fn named(kind: char) -> Option<Namespaces> {
        let tag = std::process::id() % 100_000;
        let names = [format!("bf{tag}{kind}a"), format!("bf{tag}{kind}b")];
        if !ip(&["netns", "add", &names[0]]) {
            return None;
        }
        let ns = Namespaces {
            names,
            addrs: [String::new(), String::new()],
        };
        // Created from here on, so that a failure below deletes what was made.
        if !ip(&["netns", "add", &ns.names[1]]) {
            return None;
        }
        Some(ns)
    }

    /// Each namespace joined to this one by its own veth pair, on 10.71.0.0/24 and
    /// 10.72.0.0/24.
    pub fn star() -> Option<Namespaces> {
        Self::star_at(71, 's')
    }

    /// Each namespace joined to this one by its own veth pair, on 10.`net`.0.0/24 and
    /// 10.`net + 1`.0.0/24; `kind` goes into the namespaces' names (`bf<pid><kind>a`, ...), so
    /// that callers in one process do not collide.
    pub fn star_at(net: u8, kind: char) -> Option<Namespaces> {
        let mut ns = Self::named(kind)?;
        for (i, name) in ns.names.clone().iter().enumerate() {
            let (inner, outer) = (format!("{name}i"), format!("{name}o"));
            let net = net as usize + i;
            let inside = format!("10.{net}.0.2");
            let ok = ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ]) && ip(&["link", "set", &inner, "netns", name])
                && ip(&["addr", "add", &format!("10.{net}.0.1/24"), "dev", &outer])
                && ip(&["link", "set", &outer, "up"])
                && ip(&[
                    "-n",
                    name,
                    "addr",
                    "add",
                    &format!("{inside}/24"),
                    "dev",
                    &inner,
                ])
                && ip(&["-n", name, "link", "set", &inner, "up"])
                && ip(&["-n", name, "link", "set", "lo", "up"]);
            if !ok {
                // The pair dies with the namespace once its inner end is there; not before.
                let _ = ip(&["link", "del", &outer]);
                return None;
            }
            ns.addrs[i] = inside;
        }
        Some(ns)
    }

    /// The two namespaces joined to each other by one veth pair.
    pub fn pair() -> Option<Namespaces> {
        let mut ns = Self::named('p')?;
        let ends = [format!("{}v", ns.names[0]), format!("{}v", ns.names[1])];
        if !ip(&[
            "link", "add", &ends[0], "type", "veth", "peer", "name", &ends[1],
        ]) {
            return None;
        }
        for (i, end) in ends.iter().enumerate() {
            let name = &ns.names[i];
            let addr = format!("10.73.0.{}", i + 1);
            let ok = ip(&["link", "set", end, "netns", name])
                && ip(&["-n", name, "addr", "add", &format!("{addr}/24"), "dev", end])
                && ip(&["-n", name, "link", "set", end, "up"])
                && ip(&["-n", name, "link", "set", "lo", "up"]);
            if !ok {
                // The veth pair dies with the namespaces; one end may still be out here.
                let _ = ip(&["link", "del", end]);
                return None;
            }
            ns.addrs[i] = addr;
        }
        Some(ns)
    }

    /// Adds `addr` (with its prefix, `10.72.0.1/32`) to namespace `i`'s loopback: an address
    /// that is elsewhere on the other side of a link becomes this namespace's own.
    pub fn add_local_addr(&self, i: usize, addr: &str) -> bool {
        ip(&["-n", &self.names[i], "addr", "add", addr, "dev", "lo"])
    }

    /// `program` run in namespace `i` (`ip netns exec`, which execs it: the child's pid is the
    /// program's).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[i]]).arg(program);
        c
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in &self.names {
            // Deleting a namespace deletes its veth ends, and with them their peers.
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
}
