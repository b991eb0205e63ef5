//! `bonfire bench link`: the link's own limits on this host, TCP and QUIC over 127.0.0.1.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use crate::error::CliError;
use crate::size;

/// Arguments of `bonfire bench link`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Bytes to move per measurement (binary units).
    #[arg(long, default_value = "1G", value_parser = size::parse)]
    bytes: usize,
    /// QUIC stream counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    streams: Vec<usize>,
    /// Repetitions of each measurement; the best is reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

fn tcp(bytes: usize) -> Result<f64, CliError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(CliError::io("binding 127.0.0.1"))?;
    let addr = listener
        .local_addr()
        .map_err(CliError::io("reading the listener's address"))?;
    let reader = std::thread::spawn(move || -> Result<(usize, Instant), CliError> {
        let (mut s, _) = listener
            .accept()
            .map_err(CliError::io("accepting the TCP connection"))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0;
        loop {
            match s.read(&mut buf).map_err(CliError::io("reading over TCP"))? {
                0 => return Ok((n, Instant::now())),
                k => n += k,
            }
        }
    });
    let mut s = TcpStream::connect(addr).map_err(CliError::io("connecting over TCP"))?;
    let chunk = vec![0x5au8; 1 << 20];
    let start = Instant::now();
    for _ in 0..bytes / chunk.len() {
        s.write_all(&chunk)
            .map_err(CliError::io("writing over TCP"))?;
    }
    drop(s);
    let (n, end) = reader
        .join()
        .map_err(|_| CliError::Panicked("the TCP reader"))??;
    Ok(n as f64 / (end - start).as_secs_f64() / 1e9)
}

pub(crate) fn run(args: Args) -> Result<(), CliError> {
    let best = |f: &mut dyn FnMut() -> Result<f64, CliError>| -> Result<f64, CliError> {
        let mut b: f64 = 0.0;
        for _ in 0..args.repeat.max(1) {
            b = b.max(f()?);
        }
        Ok(b)
    };
    println!(
        "# bonfire bench link: {} per measurement over 127.0.0.1, best of {}",
        size::format(args.bytes),
        args.repeat.max(1)
    );
    println!("# {:<32} {:>10} {:>8}", "link", "GB/s", "vs TCP");
    let tcp_gbps = best(&mut || tcp(args.bytes))?;
    println!(
        "  {:<32} {:>10.3} {:>8.3}",
        "TCP, one connection", tcp_gbps, 1.0
    );
    for &streams in &args.streams {
        let rt = bonfire::collectives::runtime();
        let gbps = best(&mut || {
            rt.block_on(bonfire::transport::quic::bench::loopback_throughput(
                args.bytes, streams,
            ))
            .map_err(CliError::Quic)
        })?;
        println!(
            "  {:<32} {:>10.3} {:>8.3}",
            format!(
                "QUIC (quinn, TLS 1.3), {streams} stream{}",
                if streams == 1 { "" } else { "s" }
            ),
            gbps,
            gbps / tcp_gbps
        );
    }
    println!("# GB/s = 10^9 bytes per second, from the first write to the last byte read.");
    Ok(())
}
