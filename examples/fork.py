import asyncio
from opendsec import DSecClient, DSecRunArgs
async def main():
    async with DSecClient() as client:
        sb = await client.run_sandbox(DSecRunArgs(backend="microvm", image="root/py:3.11"))
        print((await sb.run_shell("python3 -c 'print(6*7)'")).stdout.strip())
        forks = await sb.fork(count=4)    # copies with memory
        await asyncio.gather(*(s.stop() for s in [sb, *forks]))
asyncio.run(main())
