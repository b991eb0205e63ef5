//! Shared by the integration tests.
#![allow(unused_imports, unreachable_pub)]

pub use bonfire_testkit::calls::{KINDS, LENGTHS, make};
