// Node's cluster module as its documentation shows it: the primary forks WORKERS workers that
// all "listen" on one port; on Linux (schedulingPolicy SCHED_RR, the default) the primary
// accepts every connection and hands it to a worker over the IPC channel (SCM_RIGHTS).
// Each answer is 16 KiB; the worker's pid is in an `x-worker` header.
// Usage: node cluster.js PORT WORKERS
const cluster = require('cluster');
const http = require('http');

const port = Number(process.argv[2]);
const workers = Number(process.argv[3] || 2);
const body = Buffer.alloc(16384);
for (let i = 0; i < body.length; i++) body[i] = Math.imul(i, 2654435761) >>> 24;

if (cluster.isPrimary) {
  console.log('primary ' + process.pid + ' schedulingPolicy ' + cluster.schedulingPolicy);
  let online = 0;
  for (let i = 0; i < workers; i++) cluster.fork();
  cluster.on('listening', (w, addr) => {
    online += 1;
    console.log('worker ' + w.process.pid + ' listening on ' + JSON.stringify(addr));
    if (online === workers) console.log('READY');
  });
  cluster.on('exit', (w, code, signal) => {
    console.error('ERROR worker ' + w.process.pid + ' exited: ' + (signal || code));
  });
} else {
  let served = 0;
  const server = http.createServer((req, res) => {
    req.resume();
    served += 1;
    res.writeHead(200, {
      'Content-Type': 'application/octet-stream',
      'Content-Length': body.length,
      'x-worker': String(process.pid),
    });
    res.end(body);
  });
  server.on('error', (e) => { console.error('ERROR', e); process.exit(1); });
  // wrk resets its connections when its time is up: a read sees ECONNRESET, a write after
  // the reset was reported EPIPE (as over TCP: once ECONNRESET, then EPIPE), which Node itself
  // ignores; anything else (a request Node cannot parse) is an error.
  server.on('clientError', (e, sock) => {
    const what = e.code === 'ECONNRESET' || e.code === 'EPIPE' ? 'note' : 'ERROR';
    console.error(what + ' clientError in worker ' + process.pid + ': ' + e.code + ' ' + e.message);
    sock.destroy();
  });
  server.listen(port, '127.0.0.1');
  process.on('SIGTERM', () => {
    console.log('worker ' + process.pid + ' served ' + served);
    process.exit(0);
  });
}
