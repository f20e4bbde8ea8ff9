//! `kvferry serve --metrics-listen`: a `/metrics` endpoint for Prometheus (the agents' numbers
//! as `kvferry_transfer::metrics` renders them) on a plain HTTP/1.1 listener of its own.
//!
//! One connection at a time, each answered and closed: a scraper asks every few seconds, and
//! a client that sends nothing is dropped after [`IO_TIMEOUT`]. `GET /metrics` gets the text;
//! any other path 404, any other method 405; a request head over [`MAX_HEAD`] bytes 431.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a connection may take to send its request or take the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest request head read.
pub const MAX_HEAD: usize = 8 * 1024;

/// Serves `render()` at `/metrics` on `listener` from a thread of its own, for as long as the
/// process runs or until `render` returns `None` (its source stopped).
///
/// # Errors
///
/// The thread cannot be started.
pub fn spawn(
    listener: TcpListener,
    render: impl Fn() -> Option<String> + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                match answer(stream, &render) {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(e) => tracing::debug!(error = %e, "metrics connection failed"),
                }
            }
        })
}

/// Answers one connection; false when the source has stopped.
fn answer(mut stream: TcpStream, render: &impl Fn() -> Option<String>) -> std::io::Result<bool> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_HEAD {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "text/plain",
                "",
            )
            .map(|()| true);
        }
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(true);
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    if path != "/metrics" {
        respond(&mut stream, "404 Not Found", "text/plain", "try /metrics\n")?;
        return Ok(true);
    }
    if method != "GET" && method != "HEAD" {
        respond(&mut stream, "405 Method Not Allowed", "text/plain", "")?;
        return Ok(true);
    }
    let Some(body) = render() else {
        respond(
            &mut stream,
            "503 Service Unavailable",
            "text/plain",
            "stopping\n",
        )?;
        return Ok(false);
    };
    let body = if method == "HEAD" { "" } else { body.as_str() };
    respond(
        &mut stream,
        "200 OK",
        kvferry_transfer::metrics::CONTENT_TYPE,
        body,
    )?;
    Ok(true)
}

fn respond(stream: &mut TcpStream, status: &str, kind: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

/// `GET http://{addr}/metrics` over a plain socket: the status code and the body (for tests
/// and `kvferry demo`, which read the servers' numbers back).
///
/// # Errors
///
/// The connection fails, or the answer is not HTTP.
pub fn get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP answer");
    let (head, body) = answer.split_once("\r\n\r\n").ok_or_else(bad)?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(bad)?;
    Ok((status, body.to_string()))
}
