//! `kvferry serve --metrics-listen`: a `/metrics` endpoint for Prometheus (the agents' numbers
//! as `kvferry_transfer::metrics` renders them) and the probes `/healthz` and `/readyz`, on a
//! plain HTTP/1.1 listener of its own.
//!
//! One connection at a time, each answered and closed: a scraper asks every few seconds, and
//! a client that sends nothing is dropped after [`IO_TIMEOUT`]. `GET /metrics` gets the text;
//! `GET /healthz` 200 `ok` for as long as the listener answers (the process serves);
//! `GET /readyz` 200 `ready` while the [`Source`] says its agents take requests, else 503
//! with the reason; any other path 404, any other method 405; a request head over
//! [`MAX_HEAD`] bytes 431. Once the source has stopped, `/metrics` and `/readyz` answer 503
//! `stopping` and the listener closes.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a connection may take to send its request or take the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest request head read.
pub const MAX_HEAD: usize = 8 * 1024;

/// What `/readyz` answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// The agents take requests: 200.
    Ready,
    /// Not (yet, or any more) taking requests, and why: 503.
    NotReady(String),
    /// The source has stopped for good: 503, and the listener closes.
    Stopped,
}

/// What the listener serves: the metrics text and whether the agents take requests.
pub trait Source: Send + 'static {
    /// The metrics text now, or `None` once the source has stopped (the listener then
    /// closes).
    fn render(&self) -> Option<String>;

    /// Whether the agents take requests now (what `/readyz` answers). By default: ready
    /// for as long as [`render`](Self::render) answers.
    fn readiness(&self) -> Readiness {
        match self.render() {
            Some(_) => Readiness::Ready,
            None => Readiness::Stopped,
        }
    }
}

impl<F: Fn() -> Option<String> + Send + 'static> Source for F {
    fn render(&self) -> Option<String> {
        self()
    }
}

/// Serves `source` (see the module docs) on `listener` from a thread of its own, for as long
/// as the process runs or until the source has stopped.
///
/// # Errors
///
/// The thread cannot be started.
pub fn spawn(listener: TcpListener, source: impl Source) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                match answer(stream, &source) {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(e) => tracing::debug!(error = %e, "metrics connection failed"),
                }
            }
        })
}

/// The paths served.
const PATHS: [&str; 3] = ["/metrics", "/healthz", "/readyz"];

/// Answers one connection; false when the source has stopped.
fn answer(mut stream: TcpStream, source: &impl Source) -> std::io::Result<bool> {
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
    if !PATHS.contains(&path) {
        respond(
            &mut stream,
            "404 Not Found",
            "text/plain",
            "try /metrics, /healthz or /readyz\n",
        )?;
        return Ok(true);
    }
    if method != "GET" && method != "HEAD" {
        respond(&mut stream, "405 Method Not Allowed", "text/plain", "")?;
        return Ok(true);
    }
    let head_only = method == "HEAD";
    let (status, kind, body, serving) = match path {
        "/healthz" => ("200 OK", "text/plain", "ok\n".to_string(), true),
        "/readyz" => match source.readiness() {
            Readiness::Ready => ("200 OK", "text/plain", "ready\n".to_string(), true),
            Readiness::NotReady(why) => (
                "503 Service Unavailable",
                "text/plain",
                format!("not ready: {why}\n"),
                true,
            ),
            Readiness::Stopped => stopping(),
        },
        _ => match source.render() {
            Some(text) => (
                "200 OK",
                kvferry_transfer::metrics::CONTENT_TYPE,
                text,
                true,
            ),
            None => stopping(),
        },
    };
    let body = if head_only { "" } else { body.as_str() };
    respond(&mut stream, status, kind, body)?;
    Ok(serving)
}

/// The answer once the source has stopped (and the listener closes).
fn stopping() -> (&'static str, &'static str, String, bool) {
    (
        "503 Service Unavailable",
        "text/plain",
        "stopping\n".to_string(),
        false,
    )
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

/// `GET http://{addr}{path}` over a plain socket: the status code and the body (for tests
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A source whose readiness a test sets.
    struct Switch(Arc<AtomicBool>);

    impl Source for Switch {
        fn render(&self) -> Option<String> {
            Some("kvferry_peers 0\n".into())
        }

        fn readiness(&self) -> Readiness {
            if self.0.load(Ordering::Acquire) {
                Readiness::Ready
            } else {
                Readiness::NotReady("rank 1 has no agent".into())
            }
        }
    }

    fn serve(source: impl Source) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address").to_string();
        spawn(listener, source).expect("spawn");
        addr
    }

    /// `method path` answered: the status code.
    fn ask(addr: &str, method: &str, path: &str) -> u16 {
        let mut stream = TcpStream::connect(addr).expect("connect");
        write!(stream, "{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n").expect("write");
        let mut answer = String::new();
        stream.read_to_string(&mut answer).expect("read");
        answer
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status")
    }

    #[test]
    fn healthz_and_readyz_answer_beside_metrics_and_other_paths_are_404() {
        let ready = Arc::new(AtomicBool::new(true));
        let addr = serve(Switch(Arc::clone(&ready)));
        assert_eq!(get(&addr, "/healthz").unwrap(), (200, "ok\n".to_string()));
        assert_eq!(get(&addr, "/readyz").unwrap(), (200, "ready\n".to_string()));
        assert_eq!(get(&addr, "/readyz?verbose").unwrap().0, 200);
        assert_eq!(get(&addr, "/metrics").unwrap().0, 200);
        for path in ["/", "/health", "/healthz/", "/readyz/x", "/metricsz"] {
            assert_eq!(get(&addr, path).unwrap().0, 404, "{path}");
        }
        assert_eq!(ask(&addr, "POST", "/healthz"), 405);
        assert_eq!(ask(&addr, "DELETE", "/readyz"), 405);
        assert_eq!(ask(&addr, "HEAD", "/healthz"), 200);
        // Not ready: 503 and why; alive all the same.
        ready.store(false, Ordering::Release);
        let (status, body) = get(&addr, "/readyz").unwrap();
        assert_eq!(status, 503);
        assert!(body.contains("rank 1 has no agent"), "{body}");
        assert_eq!(get(&addr, "/healthz").unwrap().0, 200);
        ready.store(true, Ordering::Release);
        assert_eq!(get(&addr, "/readyz").unwrap().0, 200);
    }

    #[test]
    fn a_stopped_source_is_not_ready_and_closes_the_listener() {
        let live = Arc::new(AtomicBool::new(true));
        let flag = Arc::clone(&live);
        let addr = serve(move || flag.load(Ordering::Acquire).then(String::new));
        assert_eq!(get(&addr, "/readyz").unwrap().0, 200);
        live.store(false, Ordering::Release);
        assert_eq!(
            get(&addr, "/readyz").unwrap(),
            (503, "stopping\n".to_string())
        );
        // The thread has returned and dropped the listener: nothing answers any more.
        assert!(get(&addr, "/healthz").is_err());
    }

    #[test]
    fn an_oversized_head_is_431() {
        let addr = serve(|| Some(String::new()));
        let mut stream = TcpStream::connect(&addr).expect("connect");
        // One byte over, no end of head: the server reads it all before it answers (so it
        // closes with nothing unread, and the answer is not lost to a reset).
        let head = format!("GET /healthz HTTP/1.1\r\nX-Long: {}", "x".repeat(MAX_HEAD));
        stream
            .write_all(&head.as_bytes()[..=MAX_HEAD])
            .expect("write");
        let mut answer = String::new();
        stream.read_to_string(&mut answer).expect("read");
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
    }
}
